from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ack(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_UNSPECIFIED: _ClassVar[Ack]
    ACK_MEMORY: _ClassVar[Ack]
    ACK_DURABLE: _ClassVar[Ack]
ACK_UNSPECIFIED: Ack
ACK_MEMORY: Ack
ACK_DURABLE: Ack

class SessionRef(_message.Message):
    __slots__ = ("tenant", "session_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class ResumeHint(_message.Message):
    __slots__ = ("expected_pause_s", "priority")
    EXPECTED_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    expected_pause_s: float
    priority: int
    def __init__(self, expected_pause_s: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class SharedMemoryLease(_message.Message):
    __slots__ = ("lease_id", "name", "size", "lease_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    name: str
    size: int
    lease_s: float
    def __init__(self, lease_id: _Optional[str] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("offset", "length", "lease_id")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    lease_id: str
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("key", "data", "shm")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    key: str
    data: bytes
    shm: SharedMemoryRef
    def __init__(self, key: _Optional[str] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class SpillHeader(_message.Message):
    __slots__ = ("session", "layout_id", "generation", "token_ids", "chunk_keys", "ack", "hint", "ttl_s", "chunk_digests", "tail_digest", "window_digest", "model_fingerprint", "dedupe_domain")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TAIL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    layout_id: str
    generation: int
    token_ids: bytes
    chunk_keys: _containers.RepeatedScalarFieldContainer[str]
    ack: Ack
    hint: ResumeHint
    ttl_s: float
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    tail_digest: bytes
    window_digest: bytes
    model_fingerprint: str
    dedupe_domain: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., layout_id: _Optional[str] = ..., generation: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., chunk_keys: _Optional[_Iterable[str]] = ..., ack: _Optional[_Union[Ack, str]] = ..., hint: _Optional[_Union[ResumeHint, _Mapping]] = ..., ttl_s: _Optional[float] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ..., tail_digest: _Optional[bytes] = ..., window_digest: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ..., dedupe_domain: _Optional[str] = ...) -> None: ...

class SpillRequest(_message.Message):
    __slots__ = ("header", "chunk", "tail", "window")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    header: SpillHeader
    chunk: Payload
    tail: Payload
    window: Payload
    def __init__(self, header: _Optional[_Union[SpillHeader, _Mapping]] = ..., chunk: _Optional[_Union[Payload, _Mapping]] = ..., tail: _Optional[_Union[Payload, _Mapping]] = ..., window: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...

class SpillReply(_message.Message):
    __slots__ = ("generation", "tier", "chunks_written", "chunks_deduped", "durable", "bytes_received", "window_kept")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DEDUPED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_KEPT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    tier: str
    chunks_written: int
    chunks_deduped: int
    durable: bool
    bytes_received: int
    window_kept: bool
    def __init__(self, generation: _Optional[int] = ..., tier: _Optional[str] = ..., chunks_written: _Optional[int] = ..., chunks_deduped: _Optional[int] = ..., durable: _Optional[bool] = ..., bytes_received: _Optional[int] = ..., window_kept: _Optional[bool] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("session", "layer_by_layer", "want_window", "use_shared_memory", "reply_lease", "model_fingerprint")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_BY_LAYER_FIELD_NUMBER: _ClassVar[int]
    WANT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    USE_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    REPLY_LEASE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    layer_by_layer: bool
    want_window: bool
    use_shared_memory: bool
    reply_lease: str
    model_fingerprint: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., layer_by_layer: _Optional[bool] = ..., want_window: _Optional[bool] = ..., use_shared_memory: _Optional[bool] = ..., reply_lease: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class SessionHeader(_message.Message):
    __slots__ = ("layout_id", "generation", "num_tokens", "token_ids", "chunk_keys", "window_available", "replay_needed", "window_tier", "reply_segment", "chunk_digests", "tail_digest", "model_fingerprint", "dedupe_domain", "writeback_failed", "window_replayed_tokens", "window_digest", "chunk_tables")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_NEEDED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TIER_FIELD_NUMBER: _ClassVar[int]
    REPLY_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TAIL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_FAILED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TABLES_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    generation: int
    num_tokens: int
    token_ids: bytes
    chunk_keys: _containers.RepeatedScalarFieldContainer[str]
    window_available: bool
    replay_needed: bool
    window_tier: str
    reply_segment: SharedMemoryLease
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    tail_digest: bytes
    model_fingerprint: str
    dedupe_domain: str
    writeback_failed: bool
    window_replayed_tokens: int
    window_digest: bytes
    chunk_tables: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_id: _Optional[str] = ..., generation: _Optional[int] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., chunk_keys: _Optional[_Iterable[str]] = ..., window_available: _Optional[bool] = ..., replay_needed: _Optional[bool] = ..., window_tier: _Optional[str] = ..., reply_segment: _Optional[_Union[SharedMemoryLease, _Mapping]] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ..., tail_digest: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ..., dedupe_domain: _Optional[str] = ..., writeback_failed: _Optional[bool] = ..., window_replayed_tokens: _Optional[int] = ..., window_digest: _Optional[bytes] = ..., chunk_tables: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RestoredChunk(_message.Message):
    __slots__ = ("index", "tier", "payload")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    index: int
    tier: str
    payload: Payload
    def __init__(self, index: _Optional[int] = ..., tier: _Optional[str] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...

class LayerSection(_message.Message):
    __slots__ = ("stream", "layer", "chunk_index", "codes", "scales", "codes_xxh3", "scales_xxh3")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    CODES_XXH3_FIELD_NUMBER: _ClassVar[int]
    SCALES_XXH3_FIELD_NUMBER: _ClassVar[int]
    stream: str
    layer: int
    chunk_index: int
    codes: bytes
    scales: bytes
    codes_xxh3: int
    scales_xxh3: int
    def __init__(self, stream: _Optional[str] = ..., layer: _Optional[int] = ..., chunk_index: _Optional[int] = ..., codes: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., codes_xxh3: _Optional[int] = ..., scales_xxh3: _Optional[int] = ...) -> None: ...

class ResumeSummary(_message.Message):
    __slots__ = ("tier", "replayed", "replay_tokens", "restore_seconds", "replay_seconds", "window_digest")
    TIER_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    tier: str
    replayed: bool
    replay_tokens: int
    restore_seconds: float
    replay_seconds: float
    window_digest: bytes
    def __init__(self, tier: _Optional[str] = ..., replayed: _Optional[bool] = ..., replay_tokens: _Optional[int] = ..., restore_seconds: _Optional[float] = ..., replay_seconds: _Optional[float] = ..., window_digest: _Optional[bytes] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("header", "chunk", "section", "tail", "window", "summary")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SECTION_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    header: SessionHeader
    chunk: RestoredChunk
    section: LayerSection
    tail: Payload
    window: Payload
    summary: ResumeSummary
    def __init__(self, header: _Optional[_Union[SessionHeader, _Mapping]] = ..., chunk: _Optional[_Union[RestoredChunk, _Mapping]] = ..., section: _Optional[_Union[LayerSection, _Mapping]] = ..., tail: _Optional[_Union[Payload, _Mapping]] = ..., window: _Optional[_Union[Payload, _Mapping]] = ..., summary: _Optional[_Union[ResumeSummary, _Mapping]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("session", "replay_tokens", "use_shared_memory", "reply_lease", "model_fingerprint")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USE_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    REPLY_LEASE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    replay_tokens: int
    use_shared_memory: bool
    reply_lease: str
    model_fingerprint: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., replay_tokens: _Optional[int] = ..., use_shared_memory: _Optional[bool] = ..., reply_lease: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session", "timeout_s", "target_tier")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_TIER_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    timeout_s: float
    target_tier: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., timeout_s: _Optional[float] = ..., target_tier: _Optional[str] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("tier", "complete", "seconds")
    TIER_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    complete: bool
    seconds: float
    def __init__(self, tier: _Optional[str] = ..., complete: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("session", "target_tier")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_TIER_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    target_tier: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., target_tier: _Optional[str] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("tier", "window_dropped")
    TIER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DROPPED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    window_dropped: bool
    def __init__(self, tier: _Optional[str] = ..., window_dropped: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("chunks_released", "chunks_freed")
    CHUNKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FREED_FIELD_NUMBER: _ClassVar[int]
    chunks_released: int
    chunks_freed: int
    def __init__(self, chunks_released: _Optional[int] = ..., chunks_freed: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session", "layout_id", "generation", "num_tokens", "chunks", "window_tier", "last_access_unix", "tiers", "writeback_failed", "window_node_id", "window_node_address", "model_fingerprint")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TIER_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_FAILED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    layout_id: str
    generation: int
    num_tokens: int
    chunks: int
    window_tier: str
    last_access_unix: float
    tiers: _containers.RepeatedScalarFieldContainer[str]
    writeback_failed: bool
    window_node_id: str
    window_node_address: str
    model_fingerprint: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., layout_id: _Optional[str] = ..., generation: _Optional[int] = ..., num_tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., window_tier: _Optional[str] = ..., last_access_unix: _Optional[float] = ..., tiers: _Optional[_Iterable[str]] = ..., writeback_failed: _Optional[bool] = ..., window_node_id: _Optional[str] = ..., window_node_address: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class TierStat(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "items", "available", "lookups", "hits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    items: int
    available: bool
    lookups: int
    hits: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., items: _Optional[int] = ..., available: _Optional[bool] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("session", "tenant", "fleet")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    tenant: str
    fleet: bool
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., tenant: _Optional[str] = ..., fleet: _Optional[bool] = ...) -> None: ...

class FleetStat(_message.Message):
    __slots__ = ("sessions", "nodes_seen", "gc_epoch", "gc_state", "gc_sweeper", "cas", "nodes")
    class CasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NODES_SEEN_FIELD_NUMBER: _ClassVar[int]
    GC_EPOCH_FIELD_NUMBER: _ClassVar[int]
    GC_STATE_FIELD_NUMBER: _ClassVar[int]
    GC_SWEEPER_FIELD_NUMBER: _ClassVar[int]
    CAS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    nodes_seen: _containers.RepeatedScalarFieldContainer[str]
    gc_epoch: int
    gc_state: str
    gc_sweeper: str
    cas: _containers.ScalarMap[str, int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeLiveness]
    def __init__(self, sessions: _Optional[int] = ..., nodes_seen: _Optional[_Iterable[str]] = ..., gc_epoch: _Optional[int] = ..., gc_state: _Optional[str] = ..., gc_sweeper: _Optional[str] = ..., cas: _Optional[_Mapping[str, int]] = ..., nodes: _Optional[_Iterable[_Union[NodeLiveness, _Mapping]]] = ...) -> None: ...

class NodeLiveness(_message.Message):
    __slots__ = ("node_id", "address", "state", "heartbeat_age_s", "down")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    state: str
    heartbeat_age_s: float
    down: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., heartbeat_age_s: _Optional[float] = ..., down: _Optional[bool] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "sessions", "durable_bytes", "memory_bytes", "sessions_limit", "durable_bytes_limit", "memory_bytes_limit", "rejections", "retained_bytes")
    class RejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DURABLE_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    sessions: int
    durable_bytes: int
    memory_bytes: int
    sessions_limit: int
    durable_bytes_limit: int
    memory_bytes_limit: int
    rejections: _containers.ScalarMap[str, int]
    retained_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., sessions: _Optional[int] = ..., durable_bytes: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., sessions_limit: _Optional[int] = ..., durable_bytes_limit: _Optional[int] = ..., memory_bytes_limit: _Optional[int] = ..., rejections: _Optional[_Mapping[str, int]] = ..., retained_bytes: _Optional[int] = ...) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("tiers", "sessions", "writeback_queue_depth", "replays", "session", "tenant_usage", "node_id", "retained_bytes", "retained_chunks", "fleet")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_USAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStat]
    sessions: int
    writeback_queue_depth: int
    replays: int
    session: SessionInfo
    tenant_usage: TenantUsage
    node_id: str
    retained_bytes: int
    retained_chunks: int
    fleet: FleetStat
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStat, _Mapping]]] = ..., sessions: _Optional[int] = ..., writeback_queue_depth: _Optional[int] = ..., replays: _Optional[int] = ..., session: _Optional[_Union[SessionInfo, _Mapping]] = ..., tenant_usage: _Optional[_Union[TenantUsage, _Mapping]] = ..., node_id: _Optional[str] = ..., retained_bytes: _Optional[int] = ..., retained_chunks: _Optional[int] = ..., fleet: _Optional[_Union[FleetStat, _Mapping]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("tenant", "page_size", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    page_size: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tenant", "layout_id", "model_fingerprint", "dedupe_domain", "token_ids", "independent_chunks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEPENDENT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    layout_id: str
    model_fingerprint: str
    dedupe_domain: str
    token_ids: bytes
    independent_chunks: bool
    def __init__(self, tenant: _Optional[str] = ..., layout_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dedupe_domain: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., independent_chunks: _Optional[bool] = ...) -> None: ...

class HeldChunk(_message.Message):
    __slots__ = ("chunk_key", "digest", "tiers", "index")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    chunk_key: str
    digest: bytes
    tiers: _containers.RepeatedScalarFieldContainer[str]
    index: int
    def __init__(self, chunk_key: _Optional[str] = ..., digest: _Optional[bytes] = ..., tiers: _Optional[_Iterable[str]] = ..., index: _Optional[int] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("tokens_held", "chunks_held", "chunks")
    TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_HELD_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    tokens_held: int
    chunks_held: int
    chunks: _containers.RepeatedCompositeFieldContainer[HeldChunk]
    def __init__(self, tokens_held: _Optional[int] = ..., chunks_held: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[HeldChunk, _Mapping]]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("source", "new_session_id", "upto_tokens")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UPTO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    source: SessionRef
    new_session_id: str
    upto_tokens: int
    def __init__(self, source: _Optional[_Union[SessionRef, _Mapping]] = ..., new_session_id: _Optional[str] = ..., upto_tokens: _Optional[int] = ...) -> None: ...

class ForkReply(_message.Message):
    __slots__ = ("generation", "num_tokens", "chunks", "window_kept")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_KEPT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    num_tokens: int
    chunks: int
    window_kept: bool
    def __init__(self, generation: _Optional[int] = ..., num_tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., window_kept: _Optional[bool] = ...) -> None: ...

class WriteChunksHeader(_message.Message):
    __slots__ = ("tenant", "layout_id", "model_fingerprint", "dedupe_domain", "token_ids", "first_chunk", "chunk_digests", "ack", "hint", "independent_chunks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    INDEPENDENT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    layout_id: str
    model_fingerprint: str
    dedupe_domain: str
    token_ids: bytes
    first_chunk: int
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    ack: Ack
    hint: ResumeHint
    independent_chunks: bool
    def __init__(self, tenant: _Optional[str] = ..., layout_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dedupe_domain: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., first_chunk: _Optional[int] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ..., ack: _Optional[_Union[Ack, str]] = ..., hint: _Optional[_Union[ResumeHint, _Mapping]] = ..., independent_chunks: _Optional[bool] = ...) -> None: ...

class WriteChunksRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WriteChunksHeader
    chunk: Payload
    def __init__(self, header: _Optional[_Union[WriteChunksHeader, _Mapping]] = ..., chunk: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...

class WriteChunksReply(_message.Message):
    __slots__ = ("chunks_written", "chunks_deduped", "tier", "durable", "chunk_keys")
    CHUNKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DEDUPED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    chunks_written: int
    chunks_deduped: int
    tier: str
    durable: bool
    chunk_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunks_written: _Optional[int] = ..., chunks_deduped: _Optional[int] = ..., tier: _Optional[str] = ..., durable: _Optional[bool] = ..., chunk_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadChunksRequest(_message.Message):
    __slots__ = ("tenant", "layout_id", "model_fingerprint", "dedupe_domain", "token_ids", "first_chunk", "max_chunks", "chunk_digests", "use_shared_memory", "reply_lease", "refs_in_header", "independent_chunks", "in_place")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    USE_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    REPLY_LEASE_FIELD_NUMBER: _ClassVar[int]
    REFS_IN_HEADER_FIELD_NUMBER: _ClassVar[int]
    INDEPENDENT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    layout_id: str
    model_fingerprint: str
    dedupe_domain: str
    token_ids: bytes
    first_chunk: int
    max_chunks: int
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    use_shared_memory: bool
    reply_lease: str
    refs_in_header: bool
    independent_chunks: bool
    in_place: bool
    def __init__(self, tenant: _Optional[str] = ..., layout_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dedupe_domain: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., first_chunk: _Optional[int] = ..., max_chunks: _Optional[int] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ..., use_shared_memory: _Optional[bool] = ..., reply_lease: _Optional[str] = ..., refs_in_header: _Optional[bool] = ..., independent_chunks: _Optional[bool] = ..., in_place: _Optional[bool] = ...) -> None: ...

class ChunksHeader(_message.Message):
    __slots__ = ("chunk_keys", "chunk_digests", "reply_segment", "chunk_refs", "read_lease", "arena_slabs")
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    REPLY_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_REFS_FIELD_NUMBER: _ClassVar[int]
    READ_LEASE_FIELD_NUMBER: _ClassVar[int]
    ARENA_SLABS_FIELD_NUMBER: _ClassVar[int]
    chunk_keys: _containers.RepeatedScalarFieldContainer[str]
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    reply_segment: SharedMemoryLease
    chunk_refs: _containers.RepeatedCompositeFieldContainer[SharedMemoryRef]
    read_lease: str
    arena_slabs: _containers.RepeatedCompositeFieldContainer[SharedMemoryLease]
    def __init__(self, chunk_keys: _Optional[_Iterable[str]] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ..., reply_segment: _Optional[_Union[SharedMemoryLease, _Mapping]] = ..., chunk_refs: _Optional[_Iterable[_Union[SharedMemoryRef, _Mapping]]] = ..., read_lease: _Optional[str] = ..., arena_slabs: _Optional[_Iterable[_Union[SharedMemoryLease, _Mapping]]] = ...) -> None: ...

class MissingChunk(_message.Message):
    __slots__ = ("index", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReadChunksReply(_message.Message):
    __slots__ = ("header", "chunk", "missing")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    header: ChunksHeader
    chunk: RestoredChunk
    missing: MissingChunk
    def __init__(self, header: _Optional[_Union[ChunksHeader, _Mapping]] = ..., chunk: _Optional[_Union[RestoredChunk, _Mapping]] = ..., missing: _Optional[_Union[MissingChunk, _Mapping]] = ...) -> None: ...

class LayoutInfo(_message.Message):
    __slots__ = ("layout_id", "layout_json", "replayer", "builtin")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    REPLAYER_FIELD_NUMBER: _ClassVar[int]
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    layout_json: str
    replayer: str
    builtin: bool
    def __init__(self, layout_id: _Optional[str] = ..., layout_json: _Optional[str] = ..., replayer: _Optional[str] = ..., builtin: _Optional[bool] = ...) -> None: ...

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("layout_json",)
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    layout_json: str
    def __init__(self, layout_json: _Optional[str] = ...) -> None: ...

class RegisterLayoutReply(_message.Message):
    __slots__ = ("layout", "created")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    layout: LayoutInfo
    created: bool
    def __init__(self, layout: _Optional[_Union[LayoutInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class ListLayoutsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("progress_interval_s",)
    PROGRESS_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    progress_interval_s: float
    def __init__(self, progress_interval_s: _Optional[float] = ...) -> None: ...

class DrainProgress(_message.Message):
    __slots__ = ("phase", "writes_in_flight", "writeback_pending", "writeback_failed", "windows_held", "windows_released", "done", "windows_moved")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    WRITES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_PENDING_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_FAILED_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_HELD_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_MOVED_FIELD_NUMBER: _ClassVar[int]
    phase: str
    writes_in_flight: int
    writeback_pending: int
    writeback_failed: int
    windows_held: int
    windows_released: int
    done: bool
    windows_moved: int
    def __init__(self, phase: _Optional[str] = ..., writes_in_flight: _Optional[int] = ..., writeback_pending: _Optional[int] = ..., writeback_failed: _Optional[int] = ..., windows_held: _Optional[int] = ..., windows_released: _Optional[int] = ..., done: _Optional[bool] = ..., windows_moved: _Optional[int] = ...) -> None: ...

class AdoptWindowHeader(_message.Message):
    __slots__ = ("session", "generation", "window_replayed", "from_node", "window_digest", "window_bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    generation: int
    window_replayed: int
    from_node: str
    window_digest: bytes
    window_bytes: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., generation: _Optional[int] = ..., window_replayed: _Optional[int] = ..., from_node: _Optional[str] = ..., window_digest: _Optional[bytes] = ..., window_bytes: _Optional[int] = ...) -> None: ...

class AdoptWindowRequest(_message.Message):
    __slots__ = ("header", "window")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    header: AdoptWindowHeader
    window: bytes
    def __init__(self, header: _Optional[_Union[AdoptWindowHeader, _Mapping]] = ..., window: _Optional[bytes] = ...) -> None: ...

class AdoptWindowReply(_message.Message):
    __slots__ = ("adopted", "window_tier", "node_id", "declined")
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    adopted: bool
    window_tier: str
    node_id: str
    declined: str
    def __init__(self, adopted: _Optional[bool] = ..., window_tier: _Optional[str] = ..., node_id: _Optional[str] = ..., declined: _Optional[str] = ...) -> None: ...

class ListLayoutsReply(_message.Message):
    __slots__ = ("layouts",)
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutInfo]
    def __init__(self, layouts: _Optional[_Iterable[_Union[LayoutInfo, _Mapping]]] = ...) -> None: ...

class ReplayRequest(_message.Message):
    __slots__ = ("layout_id", "token_ids", "chunks", "tail", "replay_tokens", "job_id", "layout_json", "model_fingerprint")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    token_ids: bytes
    chunks: _containers.RepeatedScalarFieldContainer[bytes]
    tail: bytes
    replay_tokens: int
    job_id: str
    layout_json: str
    model_fingerprint: str
    def __init__(self, layout_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., chunks: _Optional[_Iterable[bytes]] = ..., tail: _Optional[bytes] = ..., replay_tokens: _Optional[int] = ..., job_id: _Optional[str] = ..., layout_json: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class ReplayReply(_message.Message):
    __slots__ = ("window", "replayed_tokens", "seconds", "worker", "batch_size")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    window: bytes
    replayed_tokens: int
    seconds: float
    worker: str
    batch_size: int
    def __init__(self, window: _Optional[bytes] = ..., replayed_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., worker: _Optional[str] = ..., batch_size: _Optional[int] = ...) -> None: ...
