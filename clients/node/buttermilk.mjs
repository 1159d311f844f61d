// Node.js client for the buttermilk gateway: the wire protocol of docs/protocol.md (v1).
//
// One ZeroMQ DEALER socket carries every request. A single receive loop decodes each frame
// (one msgpack map) and routes it by `id` to that request's own queue; replies nobody waits
// for are counted in `numOrphans`. Every wait is bounded by a deadline. With a lease open, a
// heartbeat renews it every ttl_s / 3 seconds and every generate carries its `lease_id`.
//
//   import { ButtermilkClient, ButtermilkError } from "./buttermilk.mjs";
//   const client = await new ButtermilkClient("tcp://127.0.0.1:5555").connect();
//   const stream = client.generate({ prompt: "Hello", max_tokens: 16 });
//   for await (const token of stream) process.stdout.write(token.text);
//   const { usage } = stream.done;   // also the generator's return value
//   client.close();
//
// Requests use the wire field names (max_tokens, token_ids, session_id, ...). The library
// checks only what it needs to route replies (the `id`, the frame size); every other field is
// sent as given and validated by the server, which answers a bad one with `bad_request`.

import { randomBytes } from "node:crypto";
import { Encoder, Decoder } from "@msgpack/msgpack";
import { Dealer } from "zeromq";

export const SCHEMA_VERSION = 1;
export const MAX_FRAME_BYTES = 5 * 1024 * 1024;
export const MAX_ID_CHARS = 256;
export const DEFAULT_ADDRESS = "tcp://127.0.0.1:5555";
export const DEFAULT_TIMEOUT_MS = 300_000; // per generate, from send to its terminal message
export const CONTROL_TIMEOUT_MS = 10_000; // per lease, session, health or stats request
export const CANCEL_GRACE_MS = 10_000; // after a deadline's cancel, wait this long for the end

// Codes the server sends (docs/protocol.md section 6) that may succeed when retried.
const RETRYABLE = new Set(["overloaded", "queue_timeout", "engine_failed", "capacity", "unavailable"]);
// Reply types this client understands; unknown types are ignored (section 14).
const REPLY_TYPES = new Set([
  "token", "done", "error", "lease", "lease_closed", "session_closed", "health_ok", "stats_reply",
]);
const TIMEOUT = Symbol("timeout");
const INT32_RANGE = 2 ** 32;

/**
 * A structured error. Server errors keep the wire `code` (bad_request, overloaded, ...);
 * errors raised by this library use client-side codes:
 *   timeout   - a deadline passed (a generate is cancelled first)
 *   closed    - the client was closed while waiting
 *   transport - the socket failed
 *   protocol  - a reply broke the protocol (e.g. a gap in token indices)
 *   invalid   - the request cannot be sent (bad id, duplicate in-flight id, oversized frame)
 */
export class ButtermilkError extends Error {
  constructor(code, message, { retryAfterMs = null, requestId = null, fromServer = false } = {}) {
    super(message);
    this.name = "ButtermilkError";
    this.code = code;
    this.retryAfterMs = retryAfterMs;
    this.requestId = requestId;
    this.fromServer = fromServer;
  }

  /** Whether the same request, sent again later, may succeed. */
  get retryable() {
    return RETRYABLE.has(this.code);
  }

  static fromMessage(msg) {
    return new ButtermilkError(String(msg.code), String(msg.message ?? ""), {
      retryAfterMs: Number.isInteger(msg.retry_after_ms) ? msg.retry_after_ms : null,
      requestId: typeof msg.id === "string" ? msg.id : null,
      fromServer: true,
    });
  }

  toJSON() {
    return { code: this.code, message: this.message, retry_after_ms: this.retryAfterMs };
  }
}

/** A single-consumer queue of the replies for one id. */
class Route {
  constructor(kind) {
    this.kind = kind; // "generate" or "control"
    this.items = [];
    this.waiter = null;
    this.draining = false; // abandoned generate: drop its messages until the terminal one
  }

  push(item) {
    if (this.waiter !== null) {
      const { resolve, timer } = this.waiter;
      this.waiter = null;
      clearTimeout(timer);
      resolve(item);
    } else {
      this.items.push(item);
    }
  }

  /** The next item, or TIMEOUT once `deadline` (a performance.now() value) has passed. */
  next(deadline) {
    if (this.items.length > 0) return Promise.resolve(this.items.shift());
    const remaining = deadline - performance.now();
    if (remaining <= 0) return Promise.resolve(TIMEOUT);
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        this.waiter = null;
        resolve(TIMEOUT);
      }, remaining);
      this.waiter = { resolve, timer };
    });
  }
}

function charCount(s) {
  let n = 0;
  for (const _ of s) n += 1; // code points, as the server counts them
  return n;
}

function isValidId(id) {
  return typeof id === "string" && id.length > 0 && charCount(id) <= MAX_ID_CHARS;
}

/**
 * JS numbers carry no int/float distinction; msgpack-javascript writes integral numbers as
 * ints (so 1.0 goes out as 1, which the server accepts for a float field). Integers of 2^32
 * and more are turned into BigInt so they go out as 64-bit ints, not as floats.
 */
function toWire(value) {
  if (typeof value === "number") {
    return Number.isSafeInteger(value) && Math.abs(value) >= INT32_RANGE ? BigInt(value) : value;
  }
  if (typeof value === "bigint") {
    if (value < -(2n ** 63n) || value >= 2n ** 64n) {
      throw new ButtermilkError("invalid", `integer ${value} does not fit in 64 bits`);
    }
    return value;
  }
  if (Array.isArray(value)) return value.map(toWire);
  if (value !== null && typeof value === "object" && !ArrayBuffer.isView(value)) {
    const out = {};
    for (const [k, v] of Object.entries(value)) out[k] = toWire(v);
    return out;
  }
  return value;
}

function isPlainMap(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value) && !ArrayBuffer.isView(value);
}

export class ButtermilkClient {
  /**
   * @param {string} address gateway endpoint, e.g. tcp://127.0.0.1:5555 or ipc:///tmp/bm.sock
   * @param {object} [options]
   * @param {number} [options.timeoutMs] default deadline of a generate (300 s)
   * @param {number} [options.controlTimeoutMs] deadline of control requests (10 s)
   * @param {number} [options.cancelGraceMs] after a generate's deadline and cancel, how long to
   *   wait for its terminal message before giving up (10 s)
   * @param {(msg: object) => void} [options.onUnrouted] called with each reply no request
   *   waits for (e.g. an `error` without `id`, answering a frame whose id was unreadable)
   */
  constructor(address = DEFAULT_ADDRESS, options = {}) {
    this.address = address;
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.controlTimeoutMs = options.controlTimeoutMs ?? CONTROL_TIMEOUT_MS;
    this.cancelGraceMs = options.cancelGraceMs ?? CANCEL_GRACE_MS;
    this.onUnrouted = options.onUnrouted ?? null;
    this.leaseId = null;
    this.leaseError = null; // a ButtermilkError once a renewal was refused (lease_expired)
    this.numOrphans = 0; // replies for ids nobody waits for, and undecodable frames
    this._routes = new Map();
    this._prefix = randomBytes(4).toString("hex");
    this._counter = 0;
    this._sock = null;
    this._sendChain = Promise.resolve();
    this._heartbeat = null;
    this._closed = false;
    this._encoder = new Encoder({ useBigInt64: true, ignoreUndefined: true });
    this._decoder = new Decoder();
  }

  /** Create the socket and start reading. ZeroMQ connects lazily: use health() to probe. */
  async connect() {
    if (this._closed) throw new ButtermilkError("closed", "client is closed");
    if (this._sock !== null) return this;
    this._sock = new Dealer({ linger: 0 });
    this._sock.connect(this.address);
    this._receiving = this._receiveLoop();
    return this;
  }

  // ---- generation ------------------------------------------------------------------------

  /**
   * Send a generate and stream its `token` messages.
   *
   * Use as `for await (const token of client.generate({prompt, max_tokens}))`. The returned
   * async generator has `.id` (the request id, for cancel) and, once it has ended, `.done`
   * (the `done` message, also the generator's return value). The request is sent on the first
   * iteration. Leaving the loop early cancels the request.
   *
   * @param {object} request wire fields of `generate` (section 4): exactly one of prompt,
   *   messages, token_ids; max_tokens, temperature, top_p, top_k, seed, stop, session_id,
   *   new_session, lease_id (default: the open lease), stream. `id` defaults to a fresh one.
   * @param {object} [options]
   * @param {number} [options.timeoutMs] deadline for the whole request; when it passes the
   *   request is cancelled and a ButtermilkError `timeout` is thrown.
   * @throws {ButtermilkError} the server's `error` (code from section 6), or a client code.
   */
  generate(request, options = {}) {
    const id = request.id ?? this._nextId();
    const message = { ...request, id };
    if (message.lease_id === undefined && this.leaseId !== null) message.lease_id = this.leaseId;
    const state = { done: null };
    const stream = this._generate(message, options.timeoutMs ?? this.timeoutMs, state);
    stream.id = id;
    Object.defineProperty(stream, "done", { get: () => state.done, enumerable: true });
    return stream;
  }

  /** Run a generate to its end: {id, text, token_ids, finish_reason, usage}. */
  async complete(request, options = {}) {
    const stream = this.generate(request, options);
    const texts = [];
    const tokenIds = [];
    for (;;) {
      const { value, done } = await stream.next();
      if (done) {
        return { id: stream.id, text: texts.join(""), token_ids: tokenIds,
                 finish_reason: value.finish_reason, usage: value.usage };
      }
      texts.push(value.text);
      tokenIds.push(...value.token_ids);
    }
  }

  async *_generate(message, timeoutMs, state) {
    const id = message.id;
    if (!isValidId(id)) {
      throw new ButtermilkError("invalid", `id must be a string of 1-${MAX_ID_CHARS} characters`);
    }
    const route = this._register(id, "generate");
    let deadline = performance.now() + timeoutMs;
    let sent = false;
    let finished = false;
    let timedOut = false;
    let expectedIndex = 0;
    try {
      await this._send({ ...message, type: "generate" }, deadline);
      sent = true;
      for (;;) {
        const msg = await route.next(deadline);
        if (msg === TIMEOUT) {
          if (!timedOut) { // deadline: cancel, then wait a grace period for the terminal message
            timedOut = true;
            deadline = performance.now() + this.cancelGraceMs;
            await this._sendQuiet({ type: "cancel", id });
            continue;
          }
          throw new ButtermilkError("timeout",
            `request ${id} passed its deadline of ${timeoutMs} ms, and no terminal message came ` +
            `within ${this.cancelGraceMs} ms of its cancel (is the server reachable?)`, { requestId: id });
        }
        if (msg instanceof ButtermilkError) { finished = true; throw msg; } // closed / transport
        if (msg.type === "token") {
          if (msg.index !== expectedIndex) {
            throw new ButtermilkError("protocol",
              `request ${id}: token index ${msg.index}, expected ${expectedIndex} (lost message)`,
              { requestId: id });
          }
          expectedIndex += Array.isArray(msg.token_ids) ? msg.token_ids.length : 0;
          if (!timedOut) yield msg;
          continue;
        }
        finished = true;
        this._routes.delete(id);
        if (msg.type === "error") throw ButtermilkError.fromMessage(msg);
        if (msg.type === "done") {
          if (timedOut) {
            throw new ButtermilkError("timeout",
              `request ${id} passed its deadline of ${timeoutMs} ms and was cancelled`, { requestId: id });
          }
          state.done = msg;
          return msg;
        }
        throw new ButtermilkError("protocol", `request ${id}: unexpected ${msg.type} message`,
                                  { requestId: id });
      }
    } finally {
      if (!sent) {
        if (this._routes.get(id) === route) this._routes.delete(id);
      } else if (!finished) {
        this._abandon(id, route);
      }
    }
  }

  /** Cancel a generate by id; it then ends with done {finish_reason: "cancelled"}. */
  async cancel(id) {
    await this._send({ type: "cancel", id }, performance.now() + this.controlTimeoutMs);
  }

  // ---- leases, sessions, health ----------------------------------------------------------

  /**
   * Open a lease and renew it every ttlS / 3 seconds; later generates carry it.
   * @returns {Promise<object>} the `lease` reply ({lease_id, ttl_s}).
   */
  async openLease(ttlS = 30, { heartbeat = true } = {}) {
    const reply = await this._control({ type: "lease_open", ttl_s: ttlS });
    this._stopHeartbeat();
    this.leaseId = reply.lease_id;
    this.leaseError = null;
    if (heartbeat) this._startHeartbeat(reply.lease_id, (reply.ttl_s * 1000) / 3);
    return reply;
  }

  /** Renew the open lease once; throws ButtermilkError `lease_expired` if it is gone. */
  async renewLease() {
    if (this.leaseId === null) throw new ButtermilkError("invalid", "no lease is open");
    return this._control({ type: "lease_renew", lease_id: this.leaseId });
  }

  /** Stop the heartbeat and close the lease (its in-flight requests end with `cancelled`). */
  async closeLease() {
    if (this.leaseId === null) throw new ButtermilkError("invalid", "no lease is open");
    const leaseId = this.leaseId;
    this._stopHeartbeat();
    this.leaseId = null;
    return this._control({ type: "lease_close", lease_id: leaseId });
  }

  /** Close a session; `leaseId` (its owner, if it has one) defaults to the open lease. */
  async closeSession(sessionId, leaseId = this.leaseId) {
    const message = { type: "session_close", session_id: sessionId };
    if (leaseId !== null && leaseId !== undefined) message.lease_id = leaseId;
    return this._control(message);
  }

  /** @returns {Promise<object>} `health_ok` ({status: "ok"|"degraded", engines_live}). */
  async health(timeoutMs = this.controlTimeoutMs) {
    return this._control({ type: "health" }, timeoutMs);
  }

  /** @returns {Promise<object>} `stats_reply` ({pool, engines, num_reservations, ...}). */
  async stats(timeoutMs = this.controlTimeoutMs) {
    return this._control({ type: "stats" }, timeoutMs);
  }

  /** Send one arbitrary, already encoded frame (for tests of malformed input). */
  async sendRaw(frame) {
    await this._send(null, performance.now() + this.controlTimeoutMs, frame);
  }

  /** Stop the heartbeat, fail every pending wait with `closed`, close the socket. Idempotent.
   *  An open lease is left to expire (call closeLease() first to end it at once). */
  close() {
    if (this._closed) return;
    this._closed = true;
    this._stopHeartbeat();
    const err = new ButtermilkError("closed", "client was closed");
    for (const route of this._routes.values()) route.push(err);
    this._routes.clear();
    if (this._sock !== null) this._sock.close();
  }

  // ---- internals -------------------------------------------------------------------------

  _nextId() {
    this._counter += 1;
    return `${this._prefix}-${this._counter}`;
  }

  _register(id, kind) {
    if (this._closed) throw new ButtermilkError("closed", "client is closed");
    if (this._sock === null) throw new ButtermilkError("closed", "call connect() first");
    if (this._routes.has(id)) {
      throw new ButtermilkError("invalid", `request id ${JSON.stringify(id)} is already in flight`,
                                { requestId: id });
    }
    const route = new Route(kind);
    this._routes.set(id, route);
    return route;
  }

  /** An unfinished generate whose consumer went away: cancel it and drop its replies. */
  _abandon(id, route) {
    if (this._routes.get(id) !== route) return;
    route.draining = true;
    route.items.length = 0;
    this._sendQuiet({ type: "cancel", id });
    // Free the id when the terminal message comes (see _dispatch), or after a grace period.
    const timer = setTimeout(() => {
      if (this._routes.get(id) === route) this._routes.delete(id);
    }, this.cancelGraceMs);
    timer.unref?.();
  }

  _encode(message) {
    const { v: _ignored, type, ...fields } = message; // `v` and `type` are the client's to set
    const frame = this._encoder.encode(toWire({ v: SCHEMA_VERSION, type, ...fields }));
    if (frame.byteLength > MAX_FRAME_BYTES) {
      throw new ButtermilkError("invalid",
        `frame of ${frame.byteLength} bytes exceeds ${MAX_FRAME_BYTES} bytes`,
        { requestId: message.id ?? null });
    }
    return frame;
  }

  /** Send one frame; sends are serialized (zeromq allows one in progress per socket). */
  async _send(message, deadline, raw = null) {
    if (this._closed || this._sock === null) throw new ButtermilkError("closed", "client is closed");
    const frame = raw ?? this._encode(message);
    const sock = this._sock;
    const sent = this._sendChain.then(() => sock.send(frame));
    this._sendChain = sent.catch(() => {});
    let timer;
    const timeout = new Promise((_, reject) => {
      timer = setTimeout(() => reject(new ButtermilkError("timeout", "send did not complete in time",
                                                          { requestId: message?.id ?? null })),
                         Math.max(0, deadline - performance.now()));
    });
    try {
      await Promise.race([sent, timeout]);
    } catch (err) {
      if (err instanceof ButtermilkError) throw err;
      throw new ButtermilkError(this._closed ? "closed" : "transport", `send failed: ${err.message}`,
                                { requestId: message?.id ?? null });
    } finally {
      clearTimeout(timer);
    }
  }

  _sendQuiet(message) {
    if (this._closed || this._sock === null) return Promise.resolve();
    return this._send(message, performance.now() + this.controlTimeoutMs).catch(() => {});
  }

  async _control(message, timeoutMs = this.controlTimeoutMs) {
    const id = this._nextId();
    const route = this._register(id, "control");
    const deadline = performance.now() + timeoutMs;
    try {
      await this._send({ ...message, id }, deadline);
      const reply = await route.next(deadline);
      if (reply === TIMEOUT) {
        throw new ButtermilkError("timeout", `no reply to ${message.type} within ${timeoutMs} ms`,
                                  { requestId: id });
      }
      if (reply instanceof ButtermilkError) throw reply;
      if (reply.type === "error") throw ButtermilkError.fromMessage(reply);
      return reply;
    } finally {
      if (this._routes.get(id) === route) this._routes.delete(id);
    }
  }

  async _receiveLoop() {
    try {
      for await (const frames of this._sock) this._dispatch(frames);
    } catch (err) {
      if (this._closed) return;
      const failure = new ButtermilkError("transport", `receive failed: ${err.message}`);
      for (const route of this._routes.values()) route.push(failure);
      this._routes.clear();
    }
  }

  _dispatch(frames) {
    let msg;
    try {
      if (frames.length !== 1) throw new Error("expected one frame per message");
      msg = this._decoder.decode(frames[0]);
    } catch {
      this.numOrphans += 1;
      return;
    }
    if (isPlainMap(msg) && msg.type === "keepalive") return; // the gateway checking we are still here
    if (!isPlainMap(msg) || msg.v !== SCHEMA_VERSION || !REPLY_TYPES.has(msg.type)) {
      this.numOrphans += 1; // undecodable, another version, or an unknown type (ignored)
      return;
    }
    const route = typeof msg.id === "string" ? this._routes.get(msg.id) : undefined;
    if (route === undefined) {
      this.numOrphans += 1;
      this.onUnrouted?.(msg);
      return;
    }
    if (route.draining) {
      if (msg.type === "done" || msg.type === "error") this._routes.delete(msg.id);
      return;
    }
    route.push(msg);
  }

  _startHeartbeat(leaseId, periodMs) {
    const beat = async () => {
      if (this._heartbeat === null || this.leaseId !== leaseId) return;
      try {
        await this._control({ type: "lease_renew", lease_id: leaseId });
      } catch (err) {
        if (err.fromServer) { // lease_expired: stop renewing, keep the reason
          this.leaseError = err;
          this._heartbeat = null;
          return;
        } // a lost renewal (timeout) is tolerated by design: ttl_s / 3
        if (err.code === "closed") return;
      }
      if (this._heartbeat !== null && this.leaseId === leaseId) schedule();
    };
    const schedule = () => {
      this._heartbeat = setTimeout(beat, periodMs);
      this._heartbeat.unref?.();
    };
    schedule();
  }

  _stopHeartbeat() {
    if (this._heartbeat !== null) clearTimeout(this._heartbeat);
    this._heartbeat = null;
  }
}
