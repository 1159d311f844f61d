#!/usr/bin/env node
// Example buttermilk client: stream a completion to stdout.
//
//   node cli.mjs --address tcp://127.0.0.1:5555 --prompt "The capital of France is" --max-tokens 8
//   node cli.mjs --prompt "Hi" --json      # one JSON line: {text, token_ids, finish_reason, usage}
//
// Exit status: 0 on success, 1 on a server or client error (with --json the error is printed
// as {"error": {code, message, retry_after_ms}} on stdout), 2 on a usage error.
// Ctrl-C cancels the request; the completion so far is kept.

import { parseArgs } from "node:util";
import { ButtermilkClient, ButtermilkError, DEFAULT_ADDRESS } from "./buttermilk.mjs";

const USAGE = `usage: node cli.mjs --prompt TEXT [options]

  --address ADDR       gateway endpoint (default ${DEFAULT_ADDRESS})
  --prompt TEXT        the input (raw text; with --chat, one user message)
  --chat               send the prompt as a chat message (the model's template is applied)
  --system TEXT        with --chat: a system message first
  --max-tokens N       completion length cap (server default 256)
  --temperature T      0 = greedy (server default 0)
  --top-p P            nucleus sampling
  --top-k K            top-k sampling
  --seed S             sampling seed
  --stop STR           stop string (repeatable)
  --timeout-s S        deadline for the whole request (default 300)
  --json               print one JSON object instead of streaming text
  -h, --help           this text`;

function fail(message) {
  process.stderr.write(`${message}\n\n${USAGE}\n`);
  process.exit(2);
}

function parseNumber(name, raw, { integer }) {
  if (raw === undefined) return undefined;
  const value = Number(raw);
  if (raw.trim() === "" || !Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    fail(`--${name} needs ${integer ? "an integer" : "a number"}, got ${JSON.stringify(raw)}`);
  }
  return value;
}

function parseCommandLine() {
  let values;
  try {
    ({ values } = parseArgs({
      options: {
        address: { type: "string", default: DEFAULT_ADDRESS },
        prompt: { type: "string" },
        chat: { type: "boolean", default: false },
        system: { type: "string" },
        "max-tokens": { type: "string" },
        temperature: { type: "string" },
        "top-p": { type: "string" },
        "top-k": { type: "string" },
        seed: { type: "string" },
        stop: { type: "string", multiple: true },
        "timeout-s": { type: "string" },
        json: { type: "boolean", default: false },
        help: { type: "boolean", short: "h", default: false },
      },
      strict: true,
    }));
  } catch (err) {
    fail(err.message);
  }
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  if (values.prompt === undefined) fail("--prompt is required");
  if (values.system !== undefined && !values.chat) fail("--system needs --chat");
  const request = {
    max_tokens: parseNumber("max-tokens", values["max-tokens"], { integer: true }),
    temperature: parseNumber("temperature", values.temperature, { integer: false }),
    top_p: parseNumber("top-p", values["top-p"], { integer: false }),
    top_k: parseNumber("top-k", values["top-k"], { integer: true }),
    seed: parseNumber("seed", values.seed, { integer: true }),
    stop: values.stop,
  };
  if (values.chat) {
    request.messages = [
      ...(values.system !== undefined ? [{ role: "system", content: values.system }] : []),
      { role: "user", content: values.prompt },
    ];
  } else {
    request.prompt = values.prompt;
  }
  const timeoutS = parseNumber("timeout-s", values["timeout-s"], { integer: false }) ?? 300;
  return { address: values.address, json: values.json, request, timeoutMs: timeoutS * 1000 };
}

async function main() {
  const { address, json, request, timeoutMs } = parseCommandLine();
  const client = await new ButtermilkClient(address, { cancelGraceMs: 5000 }).connect();
  const stream = client.generate(request, { timeoutMs });
  const onSigint = () => { client.cancel(stream.id).catch(() => {}); };
  process.on("SIGINT", onSigint);
  const texts = [];
  const tokenIds = [];
  try {
    for await (const token of stream) {
      texts.push(token.text);
      tokenIds.push(...token.token_ids);
      if (!json) process.stdout.write(token.text);
    }
    const { finish_reason, usage } = stream.done;
    if (json) {
      process.stdout.write(`${JSON.stringify({ text: texts.join(""), token_ids: tokenIds, finish_reason, usage })}\n`);
    } else {
      process.stdout.write("\n");
    }
  } catch (err) {
    if (!(err instanceof ButtermilkError)) throw err;
    if (json) process.stdout.write(`${JSON.stringify({ error: err.toJSON() })}\n`);
    else process.stdout.write(texts.length ? "\n" : "");
    const hint = err.retryAfterMs !== null ? ` (retry after ${err.retryAfterMs} ms)` : "";
    process.stderr.write(`buttermilk: ${err.code}: ${err.message}${hint}\n`);
    process.exitCode = 1;
  } finally {
    process.off("SIGINT", onSigint);
    client.close();
  }
}

await main();
