"""What the frontend needs from a model directory: tokenizer, special tokens, context length, chat template.

Reads `config.json`, `tokenizer_config.json` and `tokenizer.json` with `tokenizers` and `jinja2` only, so the
frontend never imports torch or transformers. The chat template is rendered the way transformers'
`apply_chat_template` renders it, so the prompt tokens (and so the KV block hashes the router computes) are
the ones vLLM would have produced from the same conversation.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from schemas.kafka import SamplingParams
from schemas.openai import SamplingFields

# The named special tokens transformers passes into every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names under which clients send a message's reasoning; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ModelFilesError(ValueError):
    """The model directory lacks something the frontend needs."""


# The sampling fields vLLM takes from generation_config.json (ModelConfig.get_diff_sampling_param), each with
# the value a request that omits it carries here: top_k and repetition_penalty have no "omitted" of their own.
_OMITTED: dict[str, Any] = {"temperature": None, "top_p": None, "top_k": -1, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json's sampling defaults, applied as vLLM applies them: only to what a request omits."""

    sampling: dict[str, Any] = field(default_factory=dict)
    # End-of-sequence ids beyond the tokenizer's own, which end a sequence too (unless ignore_eos).
    stop_token_ids: tuple[int, ...] = ()
    # `max_new_tokens`: the completion length of a chat request that names none (vLLM's default max_tokens).
    max_tokens: int | None = None

    @classmethod
    def read(cls, path: Path, eos_token_id: int) -> "GenerationDefaults":
        """The defaults in `path`/generation_config.json (none if the file is absent)."""
        gen = (
            _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        )
        sampling = {k: gen[k] for k in _OMITTED if isinstance(gen.get(k), (int, float))}
        if "top_k" in sampling:
            sampling["top_k"] = int(sampling["top_k"]) or -1  # transformers' 0 is "no top-k"
        eos = gen.get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
        new = gen.get("max_new_tokens")
        max_tokens = new if isinstance(new, int) and not isinstance(new, bool) and new > 0 else None
        return cls(sampling, tuple(i for i in dict.fromkeys(ids) if i != eos_token_id), max_tokens)

    def budget(self, requested: int | None, allowed: int) -> int:
        """A chat request's max_tokens, `allowed` being what it asked for (checked against the context) or,
        if it named none, the room its prompt leaves: as vLLM's get_max_tokens, `max_new_tokens` stands in
        only for an omitted value, within that room; a value the request gives is not capped by it."""
        if requested is not None or self.max_tokens is None:
            return allowed
        return min(allowed, self.max_tokens)

    def fill(self, params: SamplingParams, req: SamplingFields) -> SamplingParams:
        """`params` with the model's defaults where `req` left a field unset."""
        changes = {k: v for k, v in self.sampling.items() if getattr(req, k) == _OMITTED[k]}
        extra = [t for t in self.stop_token_ids if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            changes["stop_token_ids"] = [*params.stop_token_ids, *extra]
        return msgspec.structs.replace(params, **changes) if changes else params


@dataclass(frozen=True, eq=False)
class ModelFiles:
    """Tokenizer, special tokens, limits and compiled chat template of one model directory."""

    name: str
    path: Path
    tokenizer: Tokenizer = field(repr=False)
    # Ids the tokenizer can decode (base vocabulary plus added tokens), not config.json's padded size.
    vocab_size: int
    eos_token_id: int
    bos_token: str | None
    eos_token: str
    max_position_embeddings: int
    chat_template: str = field(repr=False)
    _template: jinja2.Template = field(repr=False)
    _template_tokens: dict[str, str] = field(repr=False)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    @classmethod
    def load(cls, path: Path, name: str, chat_template: str | None = None) -> "ModelFiles":
        """Read the model directory at `path`, to be served under `name`; `chat_template` (its text)
        replaces the model's own (vLLM's --chat-template)."""
        path = Path(path)
        config = _read_json(path / "config.json")
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))

        tokens = {
            key: token
            for key in _TEMPLATE_TOKEN_NAMES
            if (token := _token_text(tokenizer_config.get(key))) is not None
        }
        eos_token = tokens.get("eos_token")
        if eos_token is None and isinstance(config.get("eos_token_id"), int):
            eos_token = tokenizer.id_to_token(config["eos_token_id"])
        if eos_token is None:
            raise ModelFilesError(f"{path}: no eos_token in tokenizer_config.json or config.json")
        eos_token_id = tokenizer.token_to_id(eos_token)
        if eos_token_id is None:
            raise ModelFilesError(f"{path}: eos_token {eos_token!r} is not in tokenizer.json")
        tokens["eos_token"] = eos_token

        if chat_template is None:
            chat_template = _chat_template(path, tokenizer_config)
        return cls(
            name=name,
            path=path,
            tokenizer=tokenizer,
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            eos_token_id=eos_token_id,
            bos_token=tokens.get("bos_token"),
            eos_token=eos_token,
            max_position_embeddings=_max_position_embeddings(path, config),
            chat_template=chat_template,
            _template=_compile_template(chat_template),
            _template_tokens=tokens,
            generation_defaults=GenerationDefaults.read(path, eos_token_id),
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation into prompt text, as transformers' apply_chat_template(tokenize=False) does.

        Messages hold plain JSON data with string content. `extra` reaches the template as variables (for
        example `documents` or `enable_thinking`) and overrides the special tokens of the same name. Raises
        jinja2.TemplateError when the template rejects the conversation (e.g. roles out of order), which is
        the client's error.
        """
        if not messages:
            raise ModelFilesError("cannot render an empty conversation")
        # transformers drops None values (OpenAI sends content=None beside tool_calls) because templates
        # handle a missing key but print a present None as "None".
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        documents = extra.pop("documents", None)
        return self._template.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self._template_tokens, **extra},
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize `text`; pass add_special_tokens=False for a rendered chat, which already holds them.

        A rendered chat template already contains every special token the model expects (as transformers'
        apply_chat_template assumes when it tokenizes); adding them again would put a second BOS in front of
        prompts of models whose tokenizer adds one. Special-token text inside the prompt, including text a
        user typed, is encoded as the special token, as transformers does by default.

        Through `encode_batch_fast`, which gives the same ids without computing character offsets (nothing
        here reads them): a quarter less CPU per prompt than `encode`, on the frontend's hot path. It also
        releases the GIL, so a long prompt can be tokenized in a thread while the event loop goes on.
        """
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFilesError(f"{path} is missing; is this a prepared model directory?") from None
    if not isinstance(data, dict):
        raise ModelFilesError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # Older tokenizer configs store special tokens as serialized AddedToken objects.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str:
    # transformers lets chat_template.jinja override tokenizer_config.json, so a directory holding both
    # renders what transformers (and so vLLM) would render.
    jinja_path = path / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # The older multi-template format: a list of {"name", "template"}; "default" serves chats.
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ModelFilesError(f"{path}: no chat template in tokenizer_config.json or chat_template.jinja")
    return template


def _max_position_embeddings(path: Path, config: dict[str, Any]) -> int:
    # Multimodal configs keep the language model's settings under text_config.
    for section in (config, config.get("text_config")):
        if isinstance(section, dict) and isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    raise ModelFilesError(f"{path}: config.json has no max_position_embeddings")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # As transformers does: fill `reasoning_content` (and `thinking`, which gpt-oss templates read) from
    # whichever name the client used.
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}` blocks, which mark assistant text for training masks, and render their body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it as a plain class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block up to `{% endgeneration %}`."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


class _TemplateDict:
    # `dict` without dict's attributes, so a template cannot reach type internals through it.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces that refuse underscore-prefixed names, so a template cannot store its way to CPython internals.
    # jinja2's own signature (self taken from args), so `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja's own escapes HTML characters, which would change tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile_template(source: str) -> jinja2.Template:
    # The environment transformers builds in chat_template_utils._cached_compile_jinja_template; chat
    # templates come from model repositories, so they run sandboxed.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)
