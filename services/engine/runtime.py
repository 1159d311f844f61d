"""From settings to a loaded model plus the cache options every sequence on it uses."""

from __future__ import annotations

from dataclasses import replace

from shared.errors import BadRequest
from shared.settings import ModelSettings

from .cache import CacheOptions, Window, make_layer_caches
from .cache.centering import CALIBRATION_TOKENS, KeyMeans
from .cache.schemes import check_layer_numbers, check_scheme
from .model.loader import LoadedModel, load_model


def cache_options(settings: ModelSettings, loaded: LoadedModel) -> CacheOptions:
    """Validate the cache settings against the model and freeze them.

    Unless `no_kv_center_keys`, with a compressed scheme the options carry the model's mean
    keys (`default_key_means`: one raw prefill of 512 tokens; needs the tokenizer, so a model loaded
    without one stores its keys as they come).

    Raises:
        BadRequest: `max_context` above the model's advertised window, a window with
            `keep >= size`, an unknown scheme, a scheme that cannot store a layer's key or
            value width, or a layer override or raw layer past the model's layers (caught here,
            before any request, rather than at the first prefill;
            with `loaded.model` None, as in the gateway, only the scheme names are checked).
    """
    advertised = loaded.advertised_context
    max_context = settings.max_context or advertised
    if max_context > advertised:
        raise BadRequest(f"--max-context {max_context} exceeds the model's advertised context of {advertised} tokens")
    window = None
    if settings.kv_window_size is not None:
        try:
            window = Window(settings.kv_window_size, settings.kv_window_keep)
        except ValueError as exc:
            raise BadRequest(f"--kv-window-size/--kv-window-keep: {exc}") from exc
    options = CacheOptions(
        scheme=settings.kv_cache,
        max_context=max_context,
        window=window,
        raw_layers=frozenset(settings.kv_raw_layers),
    )
    try:  # every layer's parts against its own widths (read off the model: MLA, split K/V, ...)
        if loaded.model is None:  # the gateway: no weights, names only (each engine checks its model)
            check_scheme(options.scheme)
            return options
        num_layers = len(make_layer_caches(loaded.model, options))
    except ValueError as exc:
        raise BadRequest(f"--kv-cache: {exc}") from exc
    try:
        check_layer_numbers(options.scheme, options.raw_layers, num_layers)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    if not settings.no_kv_center_keys and options.scheme != "raw" and loaded.tokenizer is not None:  # it reads the text
        options = replace(options, key_means=default_key_means(loaded))
    return options


def default_key_means(loaded: LoadedModel) -> KeyMeans:
    """The model's mean keys over the first `CALIBRATION_TOKENS` of the Lee corpus (`cache.centering`)."""
    from services.eval.corpus import corpus_token_ids

    return KeyMeans.measure(loaded.model, corpus_token_ids(loaded.tokenizer, CALIBRATION_TOKENS))


def open_model(settings: ModelSettings) -> tuple[LoadedModel, CacheOptions]:
    """Load the model named by `settings.model` and derive its cache options."""
    loaded = load_model(settings.model, dtype=settings.dtype)
    return loaded, cache_options(settings, loaded)
