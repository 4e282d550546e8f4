// A minimal kvtier gRPC client: Spill and Restore of already encoded chunks, ListLayouts,
// and errors as the server names them (the `kvtier-error` trailer). Payloads always go
// inline: shared memory is the Python client's fast path only.

import path from 'node:path';
import { fileURLToPath } from 'node:url';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const PROTO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../proto/kvtier.proto');
const MAX_MESSAGE_BYTES = 64 << 20;

const definition = protoLoader.loadSync(PROTO, {
  keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
});
const kvtier = grpc.loadPackageDefinition(definition).kvtier.v1;

// A failed call: `code` the gRPC status name, `kvtierError` the class the trailer named,
// `requestId` the id the server logged and traced it under (the `x-kvtier-request-id`
// trailer: the server names one when the call sent none).
export class KVTierCallError extends Error {
  constructor(error) {
    const names = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));
    const trailer = (key) => (error.metadata ? error.metadata.get(key) : []);
    super(`${names[error.code]}: ${error.details}`);
    this.code = names[error.code];
    this.kvtierError = trailer('kvtier-error').length ? String(trailer('kvtier-error')[0]) : null;
    const requestId = trailer('x-kvtier-request-id');
    this.requestId = requestId.length ? String(requestId[0]) : null;
    this.details = error.details;
  }
}

export class Client {
  constructor(target) {
    this.stub = new kvtier.KVTier(target, grpc.credentials.createInsecure(), {
      'grpc.max_send_message_length': MAX_MESSAGE_BYTES,
      'grpc.max_receive_message_length': MAX_MESSAGE_BYTES,
    });
  }

  close() {
    this.stub.close();
  }

  // header: a SpillHeader object; items: [{kind: 'chunk'|'tail'|'window', key, data}].
  spill(header, items) {
    return new Promise((resolve, reject) => {
      const call = this.stub.Spill((error, reply) => (error ? reject(new KVTierCallError(error)) : resolve(reply)));
      call.write({ header });
      for (const { kind, key = '', data } of items) call.write({ [kind]: { key, data: Buffer.from(data) } });
      call.end();
    });
  }

  // Collects a Restore (or Resume) stream: {header, chunks: [{index, key, tier, data}],
  // sections, tail, windows, summary}.
  restore(request, method = 'Restore') {
    return new Promise((resolve, reject) => {
      const out = { header: null, chunks: [], sections: [], tail: Buffer.alloc(0), windows: [], summary: null };
      const call = this.stub[method](request);
      call.on('data', (reply) => {
        switch (reply.item) {
          case 'header': out.header = reply.header; break;
          case 'chunk': out.chunks.push({ index: reply.chunk.index, tier: reply.chunk.tier,
            key: reply.chunk.payload.key, data: payloadData(reply.chunk.payload) }); break;
          case 'section': out.sections.push(reply.section); break;
          case 'tail': out.tail = payloadData(reply.tail); break;
          case 'window': out.windows.push(payloadData(reply.window)); break;
          case 'summary': out.summary = reply.summary; break;
          default: reject(new Error(`unexpected reply item ${reply.item}`));
        }
      });
      call.on('error', (error) => reject(new KVTierCallError(error)));
      call.on('end', () => resolve(out));
    });
  }

  unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, (error, reply) => (error ? reject(new KVTierCallError(error)) : resolve(reply)));
    });
  }
}

function payloadData(payload) {
  if (payload.body !== 'data') throw new Error(`payload body ${payload.body}: only inline data was asked for`);
  return new Uint8Array(payload.data);
}
