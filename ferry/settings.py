"""One declaration of a process's settings: a frozen pydantic model whose fields carry their help, environment
variables and flag (`setting`). The command line and its `--help` are generated from it (`Settings.parser`), and
`Settings.from_args` reads each value from its flag, else its first environment variable set to a non-empty value, else
the default, and validates them all at once; a value that does not validate exits as argparse does, naming the flag.

The agent (`ferry_agent.config`) and the operator (`ferry_operator.config`) declare theirs so; the agent hands its
rank processes its own, validated, as JSON (`to_env` / `from_env`), so that no process parses settings twice."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError


def setting(
    default: Any = ...,
    help: str = "",
    *,
    env: str | tuple[str, ...] = (),
    metavar: str | None = None,
    repeat: bool = False,
    choices: Sequence[str] | None = None,
    flag: bool = True,
) -> Any:
    """A field of a `Settings` model. `env`: the variables that set it, first non-empty wins; `repeat`: a flag
    given once per item (a list); `flag=False`: set from the environment only."""
    envs = (env,) if isinstance(env, str) else tuple(env)
    extra = {"env": list(envs), "metavar": metavar, "repeat": repeat, "choices": list(choices or []), "flag": flag}
    return Field(default, description=help, json_schema_extra=extra)


class Settings(BaseModel):
    """Base of a process's settings; subclasses name the program (`PROG`) and say what it is (`DESCRIPTION`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, validate_default=True)
    PROG: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    EPILOG: ClassVar[str | None] = None

    @classmethod
    def flag(cls, name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def envs(cls, name: str) -> list[str]:
        return list(_extra(cls, name)["env"])

    @classmethod
    def parser(cls, *, add_help: bool = True) -> argparse.ArgumentParser:
        """The command line: a flag per field, its help saying its variables and default."""
        parser = argparse.ArgumentParser(
            prog=cls.PROG,
            description=cls.DESCRIPTION,
            epilog=cls.EPILOG,
            add_help=add_help,
            allow_abbrev=False,  # the operator passes the flags it does not know on to kopf
        )
        for name, info in cls.model_fields.items():
            extra = _extra(cls, name)
            if not extra["flag"]:
                continue
            where = [f"env {' or '.join(extra['env'])}"] if extra["env"] else []
            if not info.is_required():
                where.append(f"default: {_shown(info.default)}")
            help_text = f"{info.description} [{'; '.join(where)}]" if where else str(info.description)
            parser.add_argument(
                cls.flag(name),
                dest=name,
                default=None,
                action="append" if extra["repeat"] else "store",
                metavar=extra["metavar"] or (None if extra["choices"] else _metavar(info.annotation)),
                choices=extra["choices"] or None,
                help=help_text.replace("%", "%%"),
            )
        return parser

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, **fixed: Any
    ) -> Self:
        """Flags over the environment over the defaults, validated; `fixed` values win over all three."""
        parser = cls.parser()
        return cls.from_values(vars(parser.parse_args(argv)), environ, parser, **fixed)

    @classmethod
    def from_values(
        cls,
        given: Mapping[str, Any],
        environ: Mapping[str, str] | None = None,
        parser: argparse.ArgumentParser | None = None,
        **fixed: Any,
    ) -> Self:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            if given.get(name) is not None:
                values[name] = given[name]
                continue
            for var in _extra(cls, name)["env"]:
                if environ.get(var):
                    values[name] = environ[var]
                    break
        values.update(fixed)
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(_problem(cls, e) for e in exc.errors())
            (parser or cls.parser()).error(problems)

    def to_env(self) -> str:
        """This object as JSON, for a child process's `from_env`."""
        return self.model_dump_json()

    @classmethod
    def from_env(cls, text: str) -> Self:
        return cls.model_validate_json(text)


def _extra(cls: type[BaseModel], name: str) -> dict[str, Any]:
    extra = cls.model_fields[name].json_schema_extra
    assert isinstance(extra, dict), f"{cls.__name__}.{name} is not declared with setting()"
    return extra


def _metavar(annotation: Any) -> str:
    text = str(annotation)
    return "N" if "int" in text else "NUMBER" if "float" in text else "PATH" if "Path" in text else "TEXT"


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, list | tuple | dict) and not value:
        return "none"
    return str(value)


def _problem(cls: type[Settings], error: Any) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    name = str(error["loc"][0]) if error.get("loc") else ""
    if name not in cls.model_fields:
        return message
    envs = cls.envs(name)
    return cls.flag(name) + (f" (env {' or '.join(envs)})" if envs else "") + f": {message}"
