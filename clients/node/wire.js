// The kvtier wire format (docs/wire-format.md) in JavaScript: chunk encoding and
// verified decoding, int4 / int8 / bf16 / fp16 values, token-id bytes, chunk keys and
// digests. Written from the spec alone; tests/vectors/ holds the bytes it must produce.
//
// Stream tensors are plain objects, row-major:
//   { shape: [layers, entries, ...entry_shape], values: number[] (unpacked codes, or
//     bf16 values as numbers), scales: number[] | undefined (fp16 values, one per group,
//     shape [layers, entries, scales_per_entry]) }

import { blake2b } from '@noble/hashes/blake2b';
import { decompress as zstdDecompress } from 'fzstd';
import { createXXHash3 } from 'hash-wasm';

export const MAGIC = 'KVTC';
export const VERSION = 2;
export const FLAG_ZSTD = 1;
export const FLAG_EPHEMERAL = 2;
export const HEADER_BYTES = 64; // version 2; version 1: 56
export const SECTION_BYTES = 32;
const MAX_SECTIONS = 1 << 16;
const MAX_PAYLOAD = 2 ** 34;

export class WireError extends Error {}

let xxh3 = null;

// hash-wasm instantiates its WebAssembly asynchronously, once.
export async function ready() {
  if (xxh3 === null) xxh3 = await createXXHash3(0, 0);
}

// xxh3_64 with seed 0, as a BigInt.
export function xxh3_64(bytes) {
  if (xxh3 === null) throw new Error('call await ready() first');
  xxh3.init();
  xxh3.update(bytes);
  return BigInt('0x' + xxh3.digest('hex'));
}

// ---- layouts -------------------------------------------------------------------------

// A JSON string with every character past ASCII escaped as \uXXXX (lowercase hex).
function asciiString(s) {
  return JSON.stringify(s).replace(/[\u0080-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

// Canonical JSON: keys sorted by code point at every level, no whitespace, ASCII only,
// integers only (docs/wire-format.md 1).
export function canonicalJson(value) {
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(',')}]`;
  if (value === null || value === undefined) throw new WireError('a layout holds no null');
  if (typeof value === 'object') {
    const keys = Object.keys(value).sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    return `{${keys.map((k) => `${asciiString(k)}:${canonicalJson(value[k])}`).join(',')}}`;
  }
  if (typeof value === 'string') return asciiString(value);
  if (typeof value === 'number' && !Number.isSafeInteger(value)) throw new WireError('a layout holds integers only');
  return JSON.stringify(value);
}

// The canonical object of a layout: no notes; baseline only when it has one, layer_modes
// only when not empty, replay_tokens only when not 0.
export function canonicalLayout(layout) {
  const out = { ...layout };
  delete out.notes;
  if (out.baseline === null || out.baseline === undefined) delete out.baseline;
  if (!out.layer_modes || out.layer_modes.length === 0) delete out.layer_modes;
  if (!out.replay_tokens) delete out.replay_tokens;
  return out;
}

export function layoutToJson(layout) {
  return canonicalJson(canonicalLayout(layout));
}

// "<name>@<16 hex>": xxh3_64 of the canonical JSON without replayer and replay_tokens
// (neither shapes a byte on media).
export function layoutId(layout) {
  const hashed = canonicalLayout(layout);
  delete hashed.replayer;
  delete hashed.replay_tokens;
  const hash = xxh3_64(new TextEncoder().encode(canonicalJson(hashed)));
  return `${layout.name}@${hash.toString(16).padStart(16, '0')}`;
}

export function persistentStreams(layout) {
  return layout.streams.filter((s) => s.persistent);
}

export function ephemeralStreams(layout) {
  return layout.streams.filter((s) => !s.persistent);
}

export function entries(stream, numTokens) {
  return Math.floor(numTokens / stream.tokens_per_entry);
}

const prod = (xs) => xs.reduce((a, b) => a * b, 1);

export function valuesPerEntry(stream) {
  return prod(stream.entry_shape);
}

export function scalesPerEntry(stream) {
  return stream.bits === 16 ? 0 : valuesPerEntry(stream) / stream.group_size;
}

// Bytes of one layer's codes per entry: int4 packs two values in a byte, bf16 takes two.
function codeBytesPerEntry(stream) {
  return (valuesPerEntry(stream) * stream.bits) / 8;
}

// The value formats this client reads and writes (docs/wire-format.md 2.6): each bit
// width's default. A stream of another format (fp16, fp8_e4m3) is refused, not misread.
const DEFAULT_FORMAT = { 4: 'int4', 8: 'int8', 16: 'bf16' };

function checkFormat(stream) {
  if (stream.format !== undefined && stream.format !== DEFAULT_FORMAT[stream.bits]) {
    throw new WireError(`stream ${stream.name}: format ${stream.format} is not supported by this client`);
  }
}

// The section table a chunk of `numTokens` tokens of these streams must have:
// [{stream (index), layer, part, offset, length}], in payload order.
export function sectionPlan(layout, numTokens, ephemeral, names = null) {
  const list = ephemeral ? ephemeralStreams(layout) : persistentStreams(layout);
  list.forEach(checkFormat);
  const rows = [];
  let offset = 0;
  list.forEach((stream, index) => {
    if (names !== null && !names.includes(stream.name)) return;
    const n = entries(stream, numTokens);
    const parts = [[0, n * codeBytesPerEntry(stream)]];
    if (stream.bits < 16) parts.push([1, n * scalesPerEntry(stream) * 2]);
    for (const [part, length] of parts) {
      for (let layer = 0; layer < stream.layers; layer++) {
        rows.push({ stream: index, name: stream.name, layer, part, offset, length });
        offset += length;
      }
    }
  });
  return { rows, payloadBytes: offset };
}

// ---- values ----------------------------------------------------------------------------

export function packInt4(values) {
  const out = new Uint8Array(values.length / 2);
  for (let i = 0; i < out.length; i++) {
    const lo = values[2 * i];
    const hi = values[2 * i + 1];
    if (lo < -8 || lo > 7 || hi < -8 || hi > 7) throw new WireError('int4 value out of [-8, 7]');
    out[i] = (lo & 15) | ((hi & 15) << 4);
  }
  return out;
}

export function unpackInt4(bytes) {
  const out = new Array(bytes.length * 2);
  const signed = (n) => (n >= 8 ? n - 16 : n);
  for (let i = 0; i < bytes.length; i++) {
    out[2 * i] = signed(bytes[i] & 15);
    out[2 * i + 1] = signed(bytes[i] >> 4);
  }
  return out;
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

// float -> IEEE binary16 bits, rounding to nearest even.
export function toFp16Bits(x) {
  f32[0] = x;
  const bits = u32[0];
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0); // inf, NaN
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00; // overflow
  if (e <= 0) { // subnormal half (or zero)
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const mid = 1 << (shift - 1);
    if (rest > mid || (rest === mid && (half & 1))) half += 1;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half += 1; // may carry into exp
  return sign | half;
}

export function fromFp16Bits(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

// float -> bf16 bits (the high half of float32), rounding to nearest even.
export function toBf16Bits(x) {
  f32[0] = x;
  const bits = u32[0];
  if ((bits & 0x7f800000) === 0x7f800000 && bits & 0x7fffff) return (bits >>> 16) | 0x40;
  return ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;
}

export function fromBf16Bits(b) {
  u32[0] = b << 16;
  return f32[0];
}

// A stream's codes part as bytes: (layers, entries, ...codes_shape), row-major.
function codeBytes(stream, values) {
  if (stream.bits === 4) return packInt4(values);
  if (stream.bits === 8) return new Uint8Array(Int8Array.from(values).buffer);
  const out = new Uint8Array(values.length * 2);
  const view = new DataView(out.buffer);
  values.forEach((v, i) => view.setUint16(2 * i, toBf16Bits(v), true));
  return out;
}

function scaleBytes(scales) {
  const out = new Uint8Array(scales.length * 2);
  const view = new DataView(out.buffer);
  scales.forEach((s, i) => view.setUint16(2 * i, toFp16Bits(s), true));
  return out;
}

// x = code * scale of its group (float32 arithmetic).
export function dequantize(stream, values, scales) {
  return values.map((v, i) => Math.fround(v * Math.fround(scales[Math.floor(i / stream.group_size)])));
}

// ---- token ids ---------------------------------------------------------------------------

export function tokenBytes(tokenIds) {
  const out = new Uint8Array(tokenIds.length * 4);
  const view = new DataView(out.buffer);
  tokenIds.forEach((t, i) => view.setUint32(4 * i, t, true));
  return out;
}

export function tokenIds(bytes) {
  if (bytes.length % 4) throw new WireError('token id bytes are not a multiple of 4');
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
  return Array.from({ length: bytes.length / 4 }, (_, i) => view.getUint32(4 * i, true));
}

// ---- encoding ------------------------------------------------------------------------------

// One layer's slice of a stream's flat values: layer-major, so layer l is a contiguous run.
function layerSlice(flat, layers, layer) {
  const per = flat.length / layers;
  return flat.slice(layer * per, (layer + 1) * per);
}

// An uncompressed chunk (flags: EPHEMERAL only), version 2.
export function encodeChunk(layout, layoutHash, startToken, tokens, streams, { ephemeral = false } = {}) {
  const list = ephemeral ? ephemeralStreams(layout) : persistentStreams(layout);
  const names = list.map((s) => s.name).filter((n) => n in streams);
  if (names.length !== Object.keys(streams).length || (!ephemeral && names.length !== list.length)) {
    throw new WireError(`streams ${Object.keys(streams)} do not fit layout ${layout.name}`);
  }
  const plan = sectionPlan(layout, tokens.length, ephemeral, names.length === list.length ? null : names);
  const payload = new Uint8Array(plan.payloadBytes);
  for (const row of plan.rows) {
    const stream = layout.streams.find((s) => s.name === row.name);
    const data = streams[row.name];
    const bytes = row.part === 0
      ? codeBytes(stream, layerSlice(data.values, stream.layers, row.layer))
      : scaleBytes(layerSlice(data.scales, stream.layers, row.layer));
    if (bytes.length !== row.length) {
      throw new WireError(`stream ${row.name} part ${row.part}: ${bytes.length} B, plan says ${row.length}`);
    }
    payload.set(bytes, row.offset);
  }
  const tableEnd = HEADER_BYTES + SECTION_BYTES * plan.rows.length;
  const out = new Uint8Array(tableEnd + 8 + payload.length);
  const view = new DataView(out.buffer);
  out.set(new TextEncoder().encode(MAGIC), 0);
  view.setUint16(4, VERSION, true);
  view.setUint16(6, ephemeral ? FLAG_EPHEMERAL : 0, true);
  view.setBigUint64(8, layoutHash, true);
  view.setBigUint64(16, BigInt(startToken), true);
  view.setUint32(24, tokens.length, true);
  view.setUint32(28, plan.rows.length, true);
  view.setBigUint64(32, xxh3_64(tokenBytes(tokens)), true);
  view.setBigUint64(40, BigInt(payload.length), true);
  view.setBigUint64(48, BigInt(payload.length), true);
  view.setBigUint64(56, xxh3_64(payload), true);
  plan.rows.forEach((row, i) => {
    const at = HEADER_BYTES + SECTION_BYTES * i;
    view.setUint16(at, row.stream, true);
    view.setUint16(at + 2, row.layer, true);
    view.setUint8(at + 4, row.part);
    view.setBigUint64(at + 8, BigInt(row.offset), true);
    view.setBigUint64(at + 16, BigInt(row.length), true);
    view.setBigUint64(at + 24, xxh3_64(payload.subarray(row.offset, row.offset + row.length)), true);
  });
  view.setBigUint64(tableEnd, xxh3_64(out.subarray(0, tableEnd)), true);
  out.set(payload, tableEnd + 8);
  return out;
}

// ---- decoding ------------------------------------------------------------------------------

// The header and section table, checked (not the payload).
export function readHeader(buf) {
  const view = new DataView(buf.buffer, buf.byteOffset, buf.length);
  if (buf.length < 56) throw new WireError('chunk shorter than its header');
  if (new TextDecoder().decode(buf.subarray(0, 4)) !== MAGIC) throw new WireError('bad magic');
  const version = view.getUint16(4, true);
  if (version !== 1 && version !== 2) throw new WireError(`unsupported version ${version}`);
  const headerBytes = version === 1 ? 56 : 64;
  if (buf.length < headerBytes) throw new WireError('chunk shorter than its header');
  const h = {
    version,
    flags: view.getUint16(6, true),
    layoutHash: view.getBigUint64(8, true),
    startToken: Number(view.getBigUint64(16, true)),
    numTokens: view.getUint32(24, true),
    sectionCount: view.getUint32(28, true),
    tokensHash: view.getBigUint64(32, true),
    storedLen: Number(view.getBigUint64(40, true)),
    rawLen: Number(view.getBigUint64(48, true)),
    payloadChecksum: version === 1 ? null : view.getBigUint64(56, true),
  };
  if (h.sectionCount > MAX_SECTIONS || h.storedLen > MAX_PAYLOAD || h.rawLen > MAX_PAYLOAD) {
    throw new WireError('implausible header');
  }
  const tableEnd = headerBytes + SECTION_BYTES * h.sectionCount;
  h.payloadOffset = tableEnd + 8;
  if (buf.length < h.payloadOffset) throw new WireError('chunk ends inside its section table');
  if (xxh3_64(buf.subarray(0, tableEnd)) !== view.getBigUint64(tableEnd, true)) {
    throw new WireError('header checksum mismatch');
  }
  if (h.flags & ~(FLAG_ZSTD | FLAG_EPHEMERAL)) throw new WireError('unknown flags');
  if (buf.length < h.payloadOffset + h.storedLen) throw new WireError('payload truncated');
  if (!(h.flags & FLAG_ZSTD) && h.storedLen !== h.rawLen) throw new WireError('stored != raw');
  h.encodedLen = h.payloadOffset + h.storedLen;
  h.sections = [];
  for (let i = 0; i < h.sectionCount; i++) {
    const at = headerBytes + SECTION_BYTES * i;
    h.sections.push({
      stream: view.getUint16(at, true),
      layer: view.getUint16(at + 2, true),
      part: view.getUint8(at + 4),
      pad: buf.subarray(at + 5, at + 8).some((b) => b !== 0),
      offset: Number(view.getBigUint64(at + 8, true)),
      length: Number(view.getBigUint64(at + 16, true)),
      checksum: view.getBigUint64(at + 24, true),
    });
  }
  let covered = 0;
  for (const s of h.sections) {
    if (s.offset !== covered) throw new WireError('sections leave a gap or overlap');
    covered += s.length;
  }
  if (covered !== h.rawLen) throw new WireError('sections do not cover the raw payload');
  return h;
}

// The most tokens one chunk may cover: chunk_tokens (persistent); W for window streams
// and m - 1 for pending rows (ephemeral), whichever the chunk's streams allow.
export function maxChunkTokens(layout, ephemeral, names = null) {
  if (!ephemeral) return layout.chunk_tokens;
  const m = Math.max(1, ...persistentStreams(layout).map((s) => s.tokens_per_entry));
  const bounds = ephemeralStreams(layout).filter((s) => names === null || names.includes(s.name))
    .map((s) => (s.pending ? m - 1 : layout.window_tokens));
  return Math.min(...bounds);
}

// A window blob's chunks, cut by their headers.
export function splitChunks(blob) {
  const out = [];
  let rest = blob;
  while (rest.length) {
    const end = readHeader(rest).encodedLen;
    out.push(rest.subarray(0, end));
    rest = rest.subarray(end);
  }
  return out;
}

// Reads the zstd frame header's Frame_Content_Size (RFC 8878 3.1.1.1); null if absent.
function frameContentSize(frame) {
  if (frame.length < 6 || frame[0] !== 0x28 || frame[1] !== 0xb5 || frame[2] !== 0x2f || frame[3] !== 0xfd) {
    throw new WireError('payload is not a zstd frame');
  }
  const fhd = frame[4];
  const fcsFlag = fhd >> 6;
  const single = (fhd >> 5) & 1;
  const dictBytes = [0, 1, 2, 4][fhd & 3];
  const at = 5 + (single ? 0 : 1) + dictBytes;
  const size = [single ? 1 : 0, 2, 4, 8][fcsFlag];
  if (size === 0) return null;
  if (frame.length < at + size) throw new WireError('zstd frame header truncated');
  let n = 0;
  for (let i = size - 1; i >= 0; i--) n = n * 256 + frame[at + i];
  return size === 2 ? n + 256 : n;
}

// Every check of docs/wire-format.md 2.5, then the streams as { name: {shape, values, scales} }
// (values unpacked: int4/int8 codes as integers, bf16 as numbers).
export function decodeChunk(buf, layout, layoutHash, tokens) {
  const h = readHeader(buf);
  if (buf.length !== h.encodedLen) throw new WireError('trailing bytes after the payload');
  if (h.layoutHash !== layoutHash) throw new WireError('chunk belongs to another layout');
  if (tokens !== undefined && (tokens.length !== h.numTokens || xxh3_64(tokenBytes(tokens)) !== h.tokensHash)) {
    throw new WireError('chunk was encoded for other token ids');
  }
  const ephemeral = Boolean(h.flags & FLAG_EPHEMERAL);
  const list = ephemeral ? ephemeralStreams(layout) : persistentStreams(layout);
  const present = [...new Set(h.sections.map((s) => s.stream))];
  if (present.some((i) => i >= list.length) || (!ephemeral && present.length !== list.length)) {
    throw new WireError('section table names other streams');
  }
  const names = present.length === list.length ? null : present.map((i) => list[i].name);
  if (h.numTokens > maxChunkTokens(layout, ephemeral, names)) {
    throw new WireError(`chunk covers ${h.numTokens} tokens, more than layout ${layout.name} holds in one`);
  }
  const plan = sectionPlan(layout, h.numTokens, ephemeral, names);
  const same = plan.rows.length === h.sections.length && plan.rows.every((r, i) => {
    const s = h.sections[i];
    return !s.pad && s.stream === r.stream && s.layer === r.layer && s.part === r.part &&
      s.offset === r.offset && s.length === r.length;
  });
  if (!same) throw new WireError(`section table is not layout ${layout.name}'s for ${h.numTokens} tokens`);
  const stored = buf.subarray(h.payloadOffset, h.encodedLen);
  if (h.payloadChecksum !== null && xxh3_64(stored) !== h.payloadChecksum) {
    throw new WireError('payload checksum mismatch');
  }
  let payload = stored;
  if (h.flags & FLAG_ZSTD) {
    if (frameContentSize(stored) !== h.rawLen) throw new WireError('zstd frame does not declare the raw size');
    payload = zstdDecompress(stored, new Uint8Array(h.rawLen));
  }
  if (payload.length !== h.rawLen) throw new WireError('payload length mismatch');
  for (const s of h.sections) {
    if (xxh3_64(payload.subarray(s.offset, s.offset + s.length)) !== s.checksum) {
      throw new WireError(`section checksum mismatch (stream ${s.stream} layer ${s.layer} part ${s.part})`);
    }
  }
  const out = {};
  for (const row of plan.rows) {
    const stream = list[row.stream];
    const n = entries(stream, h.numTokens);
    const o = (out[stream.name] ??= {
      shape: [stream.layers, n, ...stream.entry_shape],
      values: [],
      ...(stream.bits < 16 ? { scales: [], scales_shape: [stream.layers, n, scalesPerEntry(stream)] } : {}),
    });
    const bytes = payload.subarray(row.offset, row.offset + row.length);
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
    if (row.part === 1) {
      for (let i = 0; i < bytes.length; i += 2) o.scales.push(fromFp16Bits(view.getUint16(i, true)));
    } else if (stream.bits === 4) {
      o.values.push(...unpackInt4(bytes));
    } else if (stream.bits === 8) {
      o.values.push(...new Int8Array(bytes.buffer, bytes.byteOffset, bytes.length));
    } else {
      for (let i = 0; i < bytes.length; i += 2) o.values.push(fromBf16Bits(view.getUint16(i, true)));
    }
  }
  return { header: h, streams: out };
}

// ---- keys and digests ------------------------------------------------------------------------

const utf8 = (s) => new TextEncoder().encode(s);
const person = (s) => { const p = new Uint8Array(16); p.set(utf8(s)); return p; };
const KEY_PERSON = person('kvtier-chunk-v2');
const DIGEST_PERSON = person('kvtier-bytes-v1');
const hex = (b) => Buffer.from(b).toString('hex');

export function dedupeScope(tenant, sharedDomain = '') {
  return sharedDomain ? `shared:${sharedDomain}` : `tenant:${tenant}`;
}

function lengthPrefixed(s) {
  const raw = utf8(s);
  const out = new Uint8Array(4 + raw.length);
  new DataView(out.buffer).setUint32(0, raw.length, true);
  out.set(raw, 4);
  return out;
}

export function chunkKeyInput(scope, layoutId, modelFingerprint, parent, tokens) {
  return Buffer.concat([scope, layoutId, modelFingerprint, parent].map(lengthPrefixed)
    .concat([tokenBytes(tokens)]));
}

export function chunkKey(scope, layoutId, modelFingerprint, parent, tokens) {
  const input = chunkKeyInput(scope, layoutId, modelFingerprint, parent, tokens);
  return hex(blake2b(input, { dkLen: 16, personalization: KEY_PERSON }));
}

export function chainKeys(layoutId, tokens, chunkTokens, { scope, modelFingerprint = '' }) {
  const keys = [];
  let parent = '';
  for (let start = 0; start + chunkTokens <= tokens.length; start += chunkTokens) {
    parent = chunkKey(scope, layoutId, modelFingerprint, parent, tokens.slice(start, start + chunkTokens));
    keys.push(parent);
  }
  return keys;
}

export function digest(bytes) {
  return blake2b(bytes, { dkLen: 32, personalization: DIGEST_PERSON });
}

export function layoutHashOf(layoutId) {
  return BigInt('0x' + layoutId.split('@')[1]);
}
