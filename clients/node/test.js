// The Node client's checks: `node test.js` checks the codec, keys and digests against
// tests/vectors/; `node test.js <host:port>` also registers the vectors' layout
// (`wire-test`) on that kvtier server, spills a session, restores it and verifies every
// byte.

import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { before, describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';

import { Client, KVTierCallError } from './client.js';
import * as wire from './wire.js';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const load = (name) => JSON.parse(fs.readFileSync(path.join(HERE, '../../tests/vectors', name), 'utf8'));
const CHUNKS = load('chunks.json');
const KEYS = load('keys.json');
const ERRORS = load('errors.json');
const LAYOUTS = load('layouts.json').layouts;
const LAYOUT = CHUNKS.layout;
let LAYOUT_ID; // computed from the layout (before), checked against the vectors
let LAYOUT_HASH;
const TOKENS = CHUNKS.token_ids;
const PLAIN = [...CHUNKS.chunks, CHUNKS.tail, ...CHUNKS.window.parts];
const ADDRESS = process.argv[2];
const unhex = (s) => new Uint8Array(Buffer.from(s, 'hex'));
const hex = (b) => Buffer.from(b).toString('hex');

before(async () => {
  await wire.ready();
  LAYOUT_ID = wire.layoutId(LAYOUT);
  LAYOUT_HASH = wire.layoutHashOf(LAYOUT_ID);
});

function encodeVector(v) {
  return wire.encodeChunk(LAYOUT, LAYOUT_HASH, v.start_token, v.token_ids, v.inputs, { ephemeral: v.ephemeral });
}

describe('wire format against tests/vectors', () => {
  it('computes layout ids from the canonical JSON', () => {
    assert.equal(LAYOUT_ID, CHUNKS.layout_id);
    for (const v of LAYOUTS) {
      const layout = JSON.parse(v.layout_json);
      assert.equal(wire.layoutToJson(layout), v.layout_json);
      assert.equal(wire.layoutId(layout), v.layout_id);
      const hashed = { ...layout };
      delete hashed.replayer;
      assert.equal(wire.canonicalJson(hashed), v.hashed_json);
    }
    assert.equal(wire.layoutToJson({ ...JSON.parse(LAYOUTS[0].layout_json), notes: 'x', layer_modes: [] }),
      LAYOUTS[0].layout_json);
  });

  it('refuses the value formats it does not decode, keeps their layout ids', () => {
    for (const { layout, chunk } of load('formats.json').formats) {
      const spec = JSON.parse(layout.layout_json);
      assert.equal(wire.layoutId(spec), layout.layout_id);
      assert.throws(() => wire.sectionPlan(spec, chunk.token_ids.length, false), /not supported/);
    }
  });

  it('token ids are uint32le', () => {
    assert.equal(hex(wire.tokenBytes(TOKENS)), CHUNKS.token_bytes);
    assert.deepEqual(wire.tokenIds(unhex(CHUNKS.token_bytes)), TOKENS);
  });

  for (const v of PLAIN) {
    it(`encodes ${v.name} byte for byte`, () => {
      const buf = encodeVector(v);
      assert.equal(hex(buf), v.bytes);
      assert.equal(hex(wire.digest(buf)), v.digest);
      const h = wire.readHeader(buf);
      assert.equal(h.payloadOffset, v.header.payload_offset);
      assert.equal(h.tokensHash.toString(16).padStart(16, '0'), v.header.tokens_hash);
      assert.deepEqual(h.sections.map((s) => s.checksum.toString(16).padStart(16, '0')),
        v.header.sections.map((s) => s.checksum));
    });
  }

  for (const v of [...PLAIN, ...CHUNKS.chunks_zstd]) {
    it(`decodes ${v.name} to its inputs`, () => {
      const { streams } = wire.decodeChunk(unhex(v.bytes), LAYOUT, LAYOUT_HASH, v.token_ids);
      assert.deepEqual(streams, v.inputs);
    });
  }

  it('dequantizes as code * scale', () => {
    for (const [name, want] of Object.entries(CHUNKS.dequantized)) {
      const stream = LAYOUT.streams.find((s) => s.name === name);
      const inputs = CHUNKS.session_inputs[name];
      assert.deepEqual(wire.dequantize(stream, inputs.values, inputs.scales), want);
    }
  });

  it('fp16 and bf16 conversions round to nearest even', () => {
    assert.equal(wire.toFp16Bits(1.0), 0x3c00);
    assert.equal(wire.toFp16Bits(65504), 0x7bff);
    assert.equal(wire.toFp16Bits(1e6), 0x7c00);
    assert.equal(wire.toFp16Bits(2 ** -24), 0x0001);
    assert.equal(wire.toFp16Bits(1 + 2 ** -11), 0x3c00); // a tie: to even
    assert.equal(wire.toFp16Bits(1 + 3 * 2 ** -11), 0x3c02);
    assert.ok(Number.isNaN(wire.fromFp16Bits(wire.toFp16Bits(NaN))));
    assert.equal(wire.toBf16Bits(1.0), 0x3f80);
    assert.equal(wire.fromBf16Bits(wire.toBf16Bits(-2.5)), -2.5);
    assert.equal(wire.toBf16Bits(1 + 2 ** -8), 0x3f80); // a tie: to even
  });

  it('refuses a flipped byte anywhere', () => {
    const good = unhex(CHUNKS.chunks[0].bytes);
    for (const at of [0, 10, 70, good.length - 200, good.length - 1]) {
      const bad = good.slice();
      bad[at] ^= 1;
      assert.throws(() => wire.decodeChunk(bad, LAYOUT, LAYOUT_HASH, CHUNKS.chunks[0].token_ids), wire.WireError);
    }
  });

  it('refuses a chunk over more tokens than the layout allows', () => {
    const v = CHUNKS.window.parts[1]; // pending rows: at most m - 1 = 1 token
    const more = { ...v.inputs['p.pending'], shape: [1, 2, 4], values: [...v.inputs['p.pending'].values, 0, 0, 0, 0] };
    const buf = wire.encodeChunk(LAYOUT, LAYOUT_HASH, 5, TOKENS.slice(5), { 'p.pending': more }, { ephemeral: true });
    assert.throws(() => wire.decodeChunk(buf, LAYOUT, LAYOUT_HASH, TOKENS.slice(5)), /more than layout/);
  });

  it('cuts the window blob into its chunks', () => {
    const parts = wire.splitChunks(unhex(CHUNKS.window.bytes));
    assert.deepEqual(parts.map(hex), CHUNKS.window.parts.map((p) => p.bytes));
    assert.equal(hex(wire.digest(unhex(CHUNKS.window.bytes))), CHUNKS.window.digest);
  });

  it('computes chunk keys', () => {
    assert.equal(KEYS.layout_id, LAYOUT_ID);
    for (const c of KEYS.cases) {
      assert.equal(wire.dedupeScope(c.tenant, c.dedupe_domain), c.scope);
      assert.deepEqual(wire.chainKeys(LAYOUT_ID, c.token_ids, c.chunk_tokens,
        { scope: c.scope, modelFingerprint: c.model_fingerprint }), c.chain_keys);
    }
    const c = KEYS.cases[1];
    assert.equal(hex(wire.chunkKeyInput(c.scope, LAYOUT_ID, c.model_fingerprint, '',
      c.token_ids.slice(0, c.chunk_tokens))), KEYS.first_key_input);
  });
});

// The session of the vectors, encoded by this client: chunk 0, the tail, the window.
// With `zstd`, chunk 0 is the vectors' zstd chunk (this client writes uncompressed ones).
function session(tenant, sessionId, generation, { zstd = false } = {}) {
  const size = LAYOUT.chunk_tokens;
  const chunks = zstd ? CHUNKS.chunks_zstd.map((v) => unhex(v.bytes)) : CHUNKS.chunks.map(encodeVector);
  const tail = encodeVector(CHUNKS.tail);
  const window = Buffer.concat(CHUNKS.window.parts.map(encodeVector));
  const keys = wire.chainKeys(LAYOUT_ID, TOKENS, size, { scope: wire.dedupeScope(tenant) });
  const header = {
    session: { tenant, session_id: sessionId }, layout_id: LAYOUT_ID, generation: String(generation),
    token_ids: Buffer.from(wire.tokenBytes(TOKENS)), chunk_keys: keys,
    chunk_digests: chunks.map((c) => Buffer.from(wire.digest(c))),
    tail_digest: Buffer.from(wire.digest(tail)), window_digest: Buffer.from(wire.digest(window)),
    ack: 'ACK_DURABLE',
  };
  const items = [...chunks.map((data, i) => ({ kind: 'chunk', key: keys[i], data })),
    { kind: 'tail', data: tail }, { kind: 'window', data: window }];
  return { header, items, chunks, tail, window, keys };
}

async function rejects(promise, code, kvtierError) {
  await assert.rejects(promise, (error) => {
    assert.ok(error instanceof KVTierCallError, String(error));
    assert.equal(error.code, code);
    assert.equal(error.kvtierError, kvtierError);
    assert.equal(ERRORS.classes[kvtierError], code);
    return true;
  });
}

describe('against a live server', { skip: ADDRESS ? false : 'no server address given' }, () => {
  const tenant = 'node';
  const sessionId = `node-${process.pid}`;
  let client;
  let sent;

  before(() => { client = new Client(ADDRESS); });

  it('registers its layout and lists every layout with the id of its canonical JSON', async () => {
    // any JSON encoding: the server canonicalises it
    const reply = await client.unary('RegisterLayout', { layout_json: JSON.stringify(LAYOUT, null, 2) });
    assert.equal(reply.layout.layout_id, LAYOUT_ID);
    assert.equal(reply.layout.layout_json, wire.layoutToJson(LAYOUT));
    assert.equal(reply.layout.replayer, 'none');
    assert.equal(reply.layout.builtin, false);
    const again = await client.unary('RegisterLayout', { layout_json: wire.layoutToJson(LAYOUT) });
    assert.equal(again.created, false);
    const { layouts } = await client.unary('ListLayouts', {});
    assert.ok(layouts.some((l) => l.layout_id === LAYOUT_ID));
    assert.ok(layouts.some((l) => l.builtin));
    for (const l of layouts) {
      const layout = JSON.parse(l.layout_json);
      assert.equal(wire.layoutToJson(layout), l.layout_json, l.layout_id);
      assert.equal(wire.layoutId(layout), l.layout_id);
    }
    const taken = { ...LAYOUT, chunk_tokens: 8 }; // another shape under a taken name
    await rejects(client.unary('RegisterLayout', { layout_json: JSON.stringify(taken) }),
      'INVALID_ARGUMENT', 'InvalidRequest');
  });

  it('spills a session', async () => {
    sent = session(tenant, sessionId, 1);
    const reply = await client.spill(sent.header, sent.items);
    assert.equal(reply.generation, '1');
    assert.equal(reply.chunks_written, 1);
    assert.equal(Number(reply.bytes_received), sent.items.reduce((n, i) => n + i.data.length, 0));
    assert.ok(reply.durable);
  });

  it('restores it byte for byte, verified and decoded', async () => {
    const got = await client.restore({ session: { tenant, session_id: sessionId }, want_window: true });
    const h = got.header;
    assert.equal(h.layout_id, LAYOUT_ID);
    assert.equal(h.generation, '1');
    assert.deepEqual(wire.tokenIds(new Uint8Array(h.token_ids)), TOKENS);
    assert.deepEqual(h.chunk_keys, sent.keys);
    assert.equal(got.chunks.length, 1);
    got.chunks.forEach((c, i) => {
      assert.equal(c.key, sent.keys[c.index]);
      assert.equal(hex(wire.digest(c.data)), hex(h.chunk_digests[i]));
      assert.equal(hex(c.data), hex(sent.chunks[i]));
    });
    assert.equal(hex(wire.digest(got.tail)), hex(h.tail_digest));
    assert.equal(hex(got.tail), hex(sent.tail));
    assert.equal(got.windows.length, 1);
    assert.equal(hex(got.windows[0]), hex(sent.window));
    assert.ok(got.summary !== null);
    // decode what came back: chunk 0 and the tail hold the session's inputs
    const size = LAYOUT.chunk_tokens;
    const chunk = wire.decodeChunk(got.chunks[0].data, LAYOUT, LAYOUT_HASH, TOKENS.slice(0, size));
    const tail = wire.decodeChunk(got.tail, LAYOUT, LAYOUT_HASH, TOKENS.slice(size));
    assert.deepEqual(chunk.streams, CHUNKS.chunks[0].inputs);
    assert.deepEqual(tail.streams, CHUNKS.tail.inputs);
    for (const [name, want] of Object.entries(CHUNKS.dequantized)) {
      const stream = LAYOUT.streams.find((s) => s.name === name);
      const values = [...chunk.streams[name].values, ...tail.streams[name].values];
      const scales = [...chunk.streams[name].scales, ...tail.streams[name].scales];
      // layer-major per chunk: compare layer by layer
      const layers = stream.layers;
      const per = (arr, l) => arr.slice((l * arr.length) / layers, ((l + 1) * arr.length) / layers);
      const session = [];
      for (let l = 0; l < layers; l++) {
        const v = [...per(chunk.streams[name].values, l), ...per(tail.streams[name].values, l)];
        const s = [...per(chunk.streams[name].scales, l), ...per(tail.streams[name].scales, l)];
        session.push(...wire.dequantize(stream, v, s));
      }
      assert.equal(values.length, want.length);
      assert.equal(scales.length * stream.group_size, want.length);
      assert.deepEqual(session, want);
    }
    const window = wire.splitChunks(got.windows[0]).map((part) => {
      const header = wire.readHeader(part);
      return wire.decodeChunk(part, LAYOUT, LAYOUT_HASH,
        TOKENS.slice(header.startToken, header.startToken + header.numTokens)).streams;
    });
    assert.deepEqual(window, CHUNKS.window.parts.map((p) => p.inputs));
  });

  it('restores layer by layer with the section checksums', async () => {
    const got = await client.restore({ session: { tenant, session_id: sessionId }, layer_by_layer: true });
    assert.ok(got.sections.length > 0);
    const chunks = [sent.chunks[0], sent.tail].map(wire.readHeader);
    for (const s of got.sections) {
      const stream = wire.persistentStreams(LAYOUT).findIndex((x) => x.name === s.stream);
      const rows = chunks[s.chunk_index].sections.filter((r) => r.stream === stream && r.layer === s.layer);
      assert.equal(BigInt(s.codes_xxh3), rows[0].checksum);
      assert.equal(wire.xxh3_64(new Uint8Array(s.codes)), rows[0].checksum);
      if (rows.length > 1) assert.equal(wire.xxh3_64(new Uint8Array(s.scales)), BigInt(s.scales_xxh3));
    }
  });

  it('restores a zstd chunk and decodes it', async () => {
    const zstd = session(tenant, `${sessionId}-z`, 1, { zstd: true });
    await client.spill(zstd.header, zstd.items);
    const got = await client.restore({ session: { tenant, session_id: `${sessionId}-z` } });
    assert.equal(hex(got.chunks[0].data), CHUNKS.chunks_zstd[0].bytes);
    assert.equal(hex(wire.digest(got.chunks[0].data)), hex(got.header.chunk_digests[0]));
    const decoded = wire.decodeChunk(got.chunks[0].data, LAYOUT, LAYOUT_HASH, TOKENS.slice(0, LAYOUT.chunk_tokens));
    assert.equal(decoded.header.flags & wire.FLAG_ZSTD, wire.FLAG_ZSTD);
    assert.deepEqual(decoded.streams, CHUNKS.chunks_zstd[0].inputs);
  });

  it('dedupes a second session sent by key and digest alone', async () => {
    const other = session(tenant, `${sessionId}-b`, 1);
    const items = other.items.filter((i) => i.kind !== 'chunk');
    const reply = await client.spill(other.header, items);
    assert.equal(reply.chunks_written, 0);
    assert.equal(reply.chunks_deduped, 1);
  });

  it('names the error class in the kvtier-error trailer', async () => {
    // generation 1 again, without the window: other content than the stored generation's
    const conflict = session(tenant, sessionId, 1);
    conflict.header.window_digest = Buffer.alloc(0);
    await rejects(client.spill(conflict.header, conflict.items.filter((i) => i.kind !== 'window')),
      'FAILED_PRECONDITION', 'GenerationConflict');
    const stale = session(tenant, sessionId, 0);
    await rejects(client.spill(stale.header, stale.items), 'FAILED_PRECONDITION', 'StaleGeneration');
    const unknown = session(tenant, `${sessionId}-c`, 1);
    unknown.header.layout_id = 'no-such-layout';
    await rejects(client.spill(unknown.header, unknown.items), 'INVALID_ARGUMENT', 'UnknownLayout');
    const wrongKey = session(tenant, `${sessionId}-d`, 1);
    wrongKey.header.chunk_keys = [wire.chainKeys(LAYOUT_ID, TOKENS, LAYOUT.chunk_tokens,
      { scope: wire.dedupeScope('someone-else') })[0]];
    await rejects(client.spill(wrongKey.header, wrongKey.items), 'INVALID_ARGUMENT', 'InvalidRequest');
    await rejects(client.restore({ session: { tenant, session_id: 'never-spilled' } }), 'NOT_FOUND', 'SessionNotFound');
    await assert.rejects(client.restore({ session: { tenant, session_id: 'never-spilled' } }),
      (error) => /^[0-9a-f]{32}$/.test(error.requestId)); // named by the server
  });

  it('deletes the sessions', async () => {
    for (const id of [sessionId, `${sessionId}-b`, `${sessionId}-z`]) {
      await client.unary('Delete', { session: { tenant, session_id: id } });
    }
    client.close();
  });
});
