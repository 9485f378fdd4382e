"""Command-line flags declared once, as the fields of frozen dataclasses.

A service's configuration is a frozen dataclass deriving from :class:`Flags`; each field is
one flag (:func:`flag`: its help, type, choices, bounds) or a group of flags that is a
dataclass of its own (:func:`group`, e.g. the placement flags every model-holding service
takes). From that one declaration come the argparse parser (:func:`add_arguments`), the
parsed value (:func:`from_namespace`, :func:`parse`), its checks (bounds and choices here,
anything across fields in the class's ``check``, each error naming the flag) and the command
line that starts a service with given values (:func:`to_argv`). ``specinfer up`` forwards its
own fields to the services it starts: a field declared by :func:`forward` (a copy of a
service's declaration) goes to each config class its ``to`` names (:func:`forwarded`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T", bound="Flags")
_FLAG, _GROUP, _TO = "flag", "group", "to"


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line."""

    help: str = ""
    type: Callable[[str], Any] = str
    name: str = ""  # "": --the-field-name
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    repeatable: bool = False  # given once per value; the field holds a tuple
    required: bool = False
    switch: bool = False  # a bool set by giving the flag, no value
    minimum: float | None = None  # value >= minimum
    above: float | None = None  # value > above
    maximum: float | None = None  # value <= maximum
    unit: str = ""  # what bound errors call the value, e.g. "seconds"
    # Other flags that set the field to a constant, as (flag, value, help).
    shortcuts: tuple[tuple[str, Any, str], ...] = ()

    def flag_name(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of bounds or choices, or None."""
        unit = f" {self.unit}" if self.unit else ""
        for item in (value if self.repeatable and value is not None else (value,)):
            if item is None:
                continue
            if self.choices is not None and item not in self.choices:
                return f"must be one of {', '.join(map(str, self.choices))}; got {item!r}"
            if self.minimum is not None and not item >= self.minimum:
                return f"must be >= {_number(self.minimum)}{unit}; got {item}"
            if self.above is not None and not item > self.above:
                return f"must be > {_number(self.above)}{unit}; got {item}"
            if self.maximum is not None and not item <= self.maximum:
                return f"must be <= {_number(self.maximum)}{unit}; got {item}"
        return None


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def flag(default: Any = None, help: str = "", *, type: Callable[[str], Any] | None = None,
         **how: Any) -> Any:
    """A field that is one flag. ``type`` defaults to the default's (str for None, a switch
    for a bool); ``how`` takes :class:`Flag`'s other fields."""
    if isinstance(default, bool):
        how["switch"] = True
    kind = type or (str if default is None or isinstance(default, tuple) else default.__class__)
    spec = Flag(help=help, type=kind, **how)
    if spec.choices is not None:
        spec = dataclasses.replace(spec, choices=tuple(spec.choices))
    return dataclasses.field(default=default, metadata={_FLAG: spec})


def group(cls: type[Flags]) -> Any:
    """A field holding a group of flags declared by ``cls`` (its defaults by default)."""
    return dataclasses.field(default_factory=cls, metadata={_GROUP: cls})


def forward(source: type[Flags], name: str, *, to: Sequence[type[Flags]] | None = None,
            **changes: Any) -> Any:
    """For ``up``: the field ``name`` as ``source`` declares it (flag, type, choices, bounds,
    default), with ``changes`` (``default``, ``help``, ...), forwarded to every config class
    in ``to`` (default: ``source``)."""
    declared = {f.name: f for f in dataclasses.fields(source)}[name]
    metadata = {**declared.metadata, _TO: tuple((source,) if to is None else to)}
    default = changes.pop("default", declared.default)
    if _FLAG in metadata:
        metadata[_FLAG] = dataclasses.replace(metadata[_FLAG], **changes)
    elif changes:
        raise TypeError(f"{name}: a group takes no changes")
    if default is dataclasses.MISSING:
        return dataclasses.field(default_factory=declared.default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Flags:
    """Base of a frozen config: checks each flag's bounds and choices when made, then
    ``check`` (checks across fields), raising ModelError naming the flag."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            spec = f.metadata.get(_FLAG)
            if spec is not None:
                problem = spec.problem(getattr(self, f.name))
                if problem:
                    # Imported here: a config (the TLS flags, say) loads without torch.
                    from specinfer.models import ModelError

                    raise ModelError(f"{spec.flag_name(f.name)} {problem}")
        self.check()

    def check(self) -> None:
        """Checks across fields; a subclass raises ModelError naming the flag."""


def add_arguments(parser: argparse.ArgumentParser, cls: type[Flags], prefix: str = "") -> None:
    """One argparse argument per flag of ``cls`` (groups flattened)."""
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            add_arguments(parser, f.metadata[_GROUP], f"{prefix}{f.name}.")
            continue
        spec: Flag = f.metadata[_FLAG]
        dest = prefix + f.name
        if spec.switch:
            parser.add_argument(spec.flag_name(f.name), dest=dest, action="store_true",
                                help=spec.help)
        else:
            # A repeatable flag appends to None: argparse cannot append to the tuple default.
            metavar = spec.metavar or (f.name.upper() if spec.choices is None else None)
            parser.add_argument(spec.flag_name(f.name), dest=dest, type=spec.type,
                                choices=spec.choices, metavar=metavar,
                                required=spec.required, help=spec.help,
                                action="append" if spec.repeatable else "store",
                                default=None if spec.repeatable else f.default)
        for name, value, text in spec.shortcuts:
            parser.add_argument(name, dest=dest, action="store_const", const=value, help=text)


def from_namespace(cls: type[T], namespace: argparse.Namespace, prefix: str = "") -> T:
    """The config ``cls`` holding what argparse parsed (checked: ModelError names a flag)."""
    values = {}
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            values[f.name] = from_namespace(f.metadata[_GROUP], namespace, f"{prefix}{f.name}.")
            continue
        value = getattr(namespace, prefix + f.name)
        if f.metadata[_FLAG].repeatable:
            value = f.default if value is None else tuple(value)
        values[f.name] = value
    return cls(**values)


def parse(cls: type[T], argv: Sequence[str]) -> T:
    """``argv`` parsed into ``cls`` (a usage error exits, as argparse does)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return from_namespace(cls, parser.parse_args(list(argv)))


def to_argv(cls: type[Flags], values: Mapping[str, Any]) -> list[str]:
    """The flags that give ``cls`` these ``values`` (by field name; the others keep their
    defaults). The values are checked by making the config first, so a bad one fails here,
    not in the process started with them. None and a false switch give no flag."""
    config = cls(**values)
    argv: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in values:
            argv += _field_argv(config, f)
    return argv


def _field_argv(config: Flags, f: dataclasses.Field) -> list[str]:
    value = getattr(config, f.name)
    if _GROUP in f.metadata:
        return [arg for sub in dataclasses.fields(value) for arg in _field_argv(value, sub)]
    spec: Flag = f.metadata[_FLAG]
    name = spec.flag_name(f.name)
    if value is None or (spec.switch and not value):
        return []
    if spec.switch:
        return [name]
    return [arg for item in (value if spec.repeatable else (value,)) for arg in (name, str(item))]


def forwarded(config: Flags, target: type[Flags]) -> dict[str, Any]:
    """The values of ``config``'s fields declared ``to`` ``target``, by field name."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if target in f.metadata.get(_TO, ())}
