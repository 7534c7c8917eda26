from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SourceIdentity(_message.Message):
    __slots__ = ("agent_name", "instance_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    instance_id: str
    def __init__(self, agent_name: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class TensorDescriptor(_message.Message):
    __slots__ = ("name", "addr", "nbytes", "dtype", "shape", "mem_type", "device_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: int
    nbytes: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    mem_type: str
    device_id: int
    def __init__(self, name: _Optional[str] = ..., addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ...) -> None: ...

class TensorManifest(_message.Message):
    __slots__ = ("source", "rank", "manifest_digest", "total_bytes", "nixl_metadata", "tensors")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    source: SourceIdentity
    rank: int
    manifest_digest: str
    total_bytes: int
    nixl_metadata: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDescriptor]
    def __init__(self, source: _Optional[_Union[SourceIdentity, _Mapping]] = ..., rank: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., nixl_metadata: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorDescriptor, _Mapping]]] = ...) -> None: ...

class GetTensorManifestRequest(_message.Message):
    __slots__ = ("source",)
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    source: SourceIdentity
    def __init__(self, source: _Optional[_Union[SourceIdentity, _Mapping]] = ...) -> None: ...

class GetTensorManifestResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: TensorManifest
    def __init__(self, manifest: _Optional[_Union[TensorManifest, _Mapping]] = ...) -> None: ...

class PrepareTensorReadRequest(_message.Message):
    __slots__ = ("source", "reader")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    READER_FIELD_NUMBER: _ClassVar[int]
    source: SourceIdentity
    reader: str
    def __init__(self, source: _Optional[_Union[SourceIdentity, _Mapping]] = ..., reader: _Optional[str] = ...) -> None: ...

class Holdings(_message.Message):
    __slots__ = ("held", "checksums", "complete", "readers", "max_readers", "base_uid", "unchanged")
    HELD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    MAX_READERS_FIELD_NUMBER: _ClassVar[int]
    BASE_UID_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    held: bytes
    checksums: _containers.RepeatedScalarFieldContainer[str]
    complete: bool
    readers: int
    max_readers: int
    base_uid: str
    unchanged: bytes
    def __init__(self, held: _Optional[bytes] = ..., checksums: _Optional[_Iterable[str]] = ..., complete: _Optional[bool] = ..., readers: _Optional[int] = ..., max_readers: _Optional[int] = ..., base_uid: _Optional[str] = ..., unchanged: _Optional[bytes] = ...) -> None: ...

class PrepareTensorReadResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "manifest", "holdings")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_seconds: float
    manifest: TensorManifest
    holdings: Holdings
    def __init__(self, lease_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., manifest: _Optional[_Union[TensorManifest, _Mapping]] = ..., holdings: _Optional[_Union[Holdings, _Mapping]] = ...) -> None: ...

class GetHoldingsRequest(_message.Message):
    __slots__ = ("source", "known", "wait_ms")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    source: SourceIdentity
    known: int
    wait_ms: int
    def __init__(self, source: _Optional[_Union[SourceIdentity, _Mapping]] = ..., known: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class GetHoldingsResponse(_message.Message):
    __slots__ = ("holdings",)
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    holdings: Holdings
    def __init__(self, holdings: _Optional[_Union[Holdings, _Mapping]] = ...) -> None: ...

class ReleaseTensorReadRequest(_message.Message):
    __slots__ = ("source", "lease_id")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    source: SourceIdentity
    lease_id: str
    def __init__(self, source: _Optional[_Union[SourceIdentity, _Mapping]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseTensorReadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
