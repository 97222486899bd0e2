"""Settings objects from command-line flags and `FERRY_*` environment variables, and back to flags.

Each field of a settings class (schemas/settings.py) becomes a flag (`worker_id` -> `--worker-id`) whose
default comes from the environment (`FERRY_WORKER_ID`) and then from the class.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import types
import typing
from collections.abc import Collection, Sequence
from typing import Any, Literal, TypeVar

from schemas.settings import ENV_PREFIX

S = TypeVar("S")


def sections(cls: type[Any]) -> list[tuple[type[Any], list[dataclasses.Field[Any]]]]:
    """`cls`'s fields by the settings group that declares them: its own first, then each group's, a group
    before the groups that extend it (EngineSettings before SimSettings)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    order: list[type[Any]] = []

    def visit(klass: type[Any]) -> None:
        for base in klass.__bases__:
            if dataclasses.is_dataclass(base) and base not in order:
                visit(base)
                order.append(base)

    visit(cls)
    out: list[tuple[type[Any], list[dataclasses.Field[Any]]]] = []
    for klass in [cls, *order]:
        own = [fields[n] for n in inspect.get_annotations(klass) if n in fields]
        if own:
            out.append((klass, own))
    return out


def default_text(f: dataclasses.Field[Any]) -> str:
    """A field's default as --help and the docs show it."""
    if "default" in f.metadata:
        return str(f.metadata["default"])
    return '""' if f.default == "" else str(f.default)


def _scalar_type(tp: Any) -> tuple[Any, list[Any] | None]:
    """The converter and choices for one annotated field type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = list(typing.get_args(tp))
        return type(choices[0]), choices
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _scalar_type(inner[0])
    return tp, None


# Other names of a flag: vLLM's, where a Ferry flag means the same.
ALIASES = {"model_path": ("--model",)}


def build_parser(cls: type[Any], parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per settings field, defaults taken from FERRY_* variables."""
    parser = parser or argparse.ArgumentParser()
    add_flags(parser, cls, set())
    return parser


def add_flags(parser: argparse.ArgumentParser, cls: type[Any], taken: set[str]) -> None:
    """Add a flag for each field of `cls` not in `taken` (a field another class declared), and take it;
    one help section per settings group."""
    hints = typing.get_type_hints(cls)
    for group, fields in sections(cls):
        fields = [f for f in fields if f.name not in taken]
        if not fields:
            continue
        section = parser.add_argument_group(_title(group))
        for f in fields:
            taken.add(f.name)
            flag = "--" + f.name.replace("_", "-")
            conv, choices = _scalar_type(hints[f.name])
            shown = f"(default: {default_text(f)}; env {ENV_PREFIX}{f.name.upper()})"
            help_text = f"{f.metadata.get('help', '')} {shown}".replace("%", "%%")  # argparse %-formats help
            names = [flag, *ALIASES.get(f.name, ())]
            if conv is bool:
                section.add_argument(
                    *names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
            elif "nargs" in f.metadata:  # a list of words, kept as one space-separated string
                section.add_argument(
                    *names, dest=f.name, nargs=f.metadata["nargs"], default=None, help=help_text
                )
            else:
                section.add_argument(
                    *names, dest=f.name, type=conv, choices=choices, default=None, help=help_text
                )


def _title(group: type[Any]) -> str:
    return (group.__doc__ or group.__name__).strip().splitlines()[0].rstrip(".")


def given(ns: argparse.Namespace) -> set[str]:
    """The fields set by a flag on the command line (the others come from variables or defaults)."""
    return {name for name, value in vars(ns).items() if value is not None}


def from_namespace(
    cls: type[S], ns: argparse.Namespace, environ: typing.Mapping[str, str] | None = None
) -> S:
    """Settings from parsed flags, then FERRY_* variables, then defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        flag_value = getattr(ns, f.name, None)
        if isinstance(flag_value, list):
            flag_value = " ".join(flag_value)
        if flag_value is not None:
            values[f.name] = flag_value
            continue
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is None:
            continue
        conv, choices = _scalar_type(hints[f.name])
        value = raw.strip().lower() in ("1", "true", "yes", "on") if conv is bool else conv(raw)
        if choices is not None and value not in choices:
            raise SystemExit(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected one of {choices}")
        values[f.name] = value
    return cls(**values)


EPILOG = "Every flag can also be set through its FERRY_* variable; a flag wins over the variable, which wins over the default."


def load(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """Parse `argv` into a settings object of type `cls`."""
    parser = argparse.ArgumentParser(
        prog=prog, usage="%(prog)s [flags]", description=cls.__doc__, epilog=EPILOG
    )
    build_parser(cls, parser)
    return from_namespace(cls, parser.parse_args(argv))


ENGINE_EPILOG = (
    "Any other flag, and everything after `--`, is one of vLLM's own engine flags (those of `vllm serve`: "
    "--dtype, --tensor-parallel-size, --quantization, --speculative-config, ...), read by vLLM's parser "
    "(engine vllm only)."
)


def split_engine_flags(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """Parse Ferry's flags; the rest (unknown flags, and everything after `--`) are vLLM engine flags."""
    args = list(sys.argv[1:] if argv is None else argv)
    head, tail = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    ns, unknown = parser.parse_known_args(head)
    return ns, [*unknown, *tail]


def load_with_engine_flags(
    cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None
) -> tuple[S, list[str]]:
    """Parse `argv` into a settings object of type `cls` and the vLLM engine flags among them."""
    parser = argparse.ArgumentParser(
        prog=prog, usage="%(prog)s [flags] [vLLM engine flags] [-- vLLM engine flags]",
        description=cls.__doc__, epilog=f"{EPILOG} {ENGINE_EPILOG}", allow_abbrev=False,
    )  # fmt: skip
    build_parser(cls, parser)
    ns, engine_flags = split_engine_flags(parser, argv)
    return from_namespace(cls, ns), engine_flags


def to_argv(settings: Any, only: Collection[str] | None = None) -> list[str]:
    """Flags that reproduce `settings` (or the named fields of it) in a child process."""
    out: list[str] = []
    for f in dataclasses.fields(settings):
        if only is not None and f.name not in only:
            continue
        value = getattr(settings, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif "nargs" in f.metadata:
            out += [flag, *value.split()] if value.split() else []
        else:
            out += [flag, str(value)]
    return out
