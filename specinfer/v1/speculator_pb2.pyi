from specinfer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TreeConfig(_message.Message):
    __slots__ = ("expansion", "max_nodes", "dynamic", "ssm_only")
    EXPANSION_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    SSM_ONLY_FIELD_NUMBER: _ClassVar[int]
    expansion: _containers.RepeatedScalarFieldContainer[int]
    max_nodes: int
    dynamic: bool
    ssm_only: bool
    def __init__(self, expansion: _Optional[_Iterable[int]] = ..., max_nodes: _Optional[int] = ..., dynamic: _Optional[bool] = ..., ssm_only: _Optional[bool] = ...) -> None: ...

class SpeculateItem(_message.Message):
    __slots__ = ("sequence_id", "context", "sampling", "tree", "constraint", "prompt_length")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    context: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    tree: TreeConfig
    constraint: _common_pb2.Constraint
    prompt_length: int
    def __init__(self, sequence_id: _Optional[str] = ..., context: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tree: _Optional[_Union[TreeConfig, _Mapping]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SpeculateItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SpeculateItem, _Mapping]]] = ...) -> None: ...

class SpeculateResult(_message.Message):
    __slots__ = ("sequence_id", "tree")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    tree: _common_pb2.TokenTree
    def __init__(self, sequence_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SpeculateResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SpeculateResult, _Mapping]]] = ...) -> None: ...

class StreamItem(_message.Message):
    __slots__ = ("sequence_id", "offset", "delta", "sampling", "tree", "constraint", "prompt_length")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    offset: int
    delta: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    tree: TreeConfig
    constraint: _common_pb2.Constraint
    prompt_length: int
    def __init__(self, sequence_id: _Optional[str] = ..., offset: _Optional[int] = ..., delta: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tree: _Optional[_Union[TreeConfig, _Mapping]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class SpeculateStreamRequest(_message.Message):
    __slots__ = ("step", "items", "release", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    step: int
    items: _containers.RepeatedCompositeFieldContainer[StreamItem]
    release: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, step: _Optional[int] = ..., items: _Optional[_Iterable[_Union[StreamItem, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SpeculateStreamResponse(_message.Message):
    __slots__ = ("step", "results")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    results: _containers.RepeatedCompositeFieldContainer[SpeculateResult]
    def __init__(self, step: _Optional[int] = ..., results: _Optional[_Iterable[_Union[SpeculateResult, _Mapping]]] = ...) -> None: ...
