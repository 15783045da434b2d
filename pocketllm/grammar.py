"""Structured outputs with xgrammar (vLLM's default backend): a request's constraint
(`SamplingParams.structured_outputs`) compiled once at submission, a matcher per request, and the
mask of the tokens it allows applied to that request's row of logits before the sampler.

`Grammars` is an engine's compiler: xgrammar's TokenizerInfo built on first use from the model's
tokenizer (each id's bytes, `tokenizer.vocab_bytes`; the width is the model's vocab_size, the
logits', and EOS is the stop token), compiled grammars kept per (kind, spec, whitespace rule).
`GrammarState` is one request's place in its grammar: `apply` masks its row (-inf where the
grammar allows no token; the other logits keep their bits), `advance` feeds the matcher the
request's tokens it has not taken yet. The mask is read from this request's matcher alone and
applied row by row, so a constrained request gets the same bits alone and in any batch; a token is
taken once, so a request prefilled again after a preemption by recompute never re-advances its
matcher. xgrammar is imported only when a request asks for structured output.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .logits_processors import LogitsControlError
from .sampling import SamplingParams
from .structured_outputs import StructuredOutputsParams
from .tokenizer import TOKENIZER_FILE, load_tokenizer, vocab_bytes

if TYPE_CHECKING:
    from tokenizers import Tokenizer

INSTALL_HINT = "structured outputs need the xgrammar package: pip install 'pocketllm[structured]'"
MAX_CACHED = 256  # compiled grammars kept (the least recently used go first)
_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit i of a bitmask word: token 32 * word + i
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:94: "


class GrammarError(ValueError):
    """A structured-output constraint xgrammar cannot compile (a bad JSON schema, regex or grammar):
    `kind` is its field, `reason` xgrammar's words."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind}: {reason}")
        self.kind, self.reason = kind, reason


def xgrammar() -> Any:
    """The xgrammar module; ImportError naming the extra to install without it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar whose sentences are exactly `choices` (vLLM's, quotes and backslashes escaped)."""
    return "root ::= " + " | ".join('"' + re.sub(r'(["\\])', r"\\\1", choice) + '"' for choice in choices)


def _compile(compiler: Any, spec: StructuredOutputsParams) -> Any:
    any_whitespace = not spec.disable_any_whitespace
    if spec.json is not None:
        return compiler.compile_json_schema(spec.json, any_whitespace=any_whitespace)
    if spec.json_object:
        return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=any_whitespace)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    if spec.choice is not None:
        return compiler.compile_grammar(choice_grammar(spec.choice))
    assert spec.grammar is not None
    return compiler.compile_grammar(spec.grammar)


class Grammars:
    """An engine's grammar compiler (see the module docstring). `tokenizer`: the model's, when the
    engine loaded one; else it is loaded from `model_dir` on first use."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 tokenizer: Tokenizer | None = None) -> None:
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, tuple(eos_token_ids)
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, Any, bool], Any] = OrderedDict()
        self._lock = threading.Lock()  # submissions compile from any thread

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = xgrammar()
            if not self.eos_token_ids:
                raise ValueError("structured_outputs needs the model's EOS token (eos_token_id in its config), "
                                 "which ends a complete output; this model has none")
            tokenizer = self._tokenizer
            if tokenizer is None:
                tokenizer = self._load_tokenizer()
            info = xgr.TokenizerInfo(vocab_bytes(tokenizer, self.vocab_size), xgr.VocabType.RAW,
                                     vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids))
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def _load_tokenizer(self) -> Tokenizer:
        if not (Path(self.model_dir) / TOKENIZER_FILE).is_file():
            raise ValueError(f"structured_outputs needs the model's tokenizer; {self.model_dir} has no "
                             f"{TOKENIZER_FILE}")
        try:
            return load_tokenizer(self.model_dir, required=True)
        except ImportError:
            raise ImportError("structured outputs need the tokenizers package to read the model's tokenizer: "
                              "pip install 'pocketllm[structured]'") from None

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (compiled on first use, then kept): GrammarError when
        xgrammar cannot compile it, ImportError without xgrammar."""
        key = (spec.kind, spec.spec, spec.disable_any_whitespace)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            compiler = self._get_compiler()
            try:
                compiled = _compile(compiler, spec)
            except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse and conversion errors
                reason = _XGRAMMAR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
                raise GrammarError(spec.kind, f"xgrammar cannot compile it: {reason}") from None
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
            return compiled

    def state(self, params: SamplingParams) -> GrammarState | None:
        """A new request's matcher for its params' constraint (None when it sets none)."""
        spec = params.structured_outputs
        return None if spec is None else GrammarState(self.compile(spec), self.vocab_size)


def check_grammar(grammars: Grammars | None, params: SamplingParams) -> None:
    """At submission: the params' constraint compiles (GrammarError, ImportError), on an engine that has
    a compiler (ValueError otherwise)."""
    if params.structured_outputs is None:
        return
    if grammars is None:
        raise ValueError("structured_outputs needs an engine that compiles grammars (pocketllm.grammar.Grammars); "
                         "this scheduler was built without one")
    grammars.compile(params.structured_outputs)


class GrammarState:
    """One request's xgrammar matcher and its token bitmask; `accepted`: how many of the request's
    output tokens the matcher has taken."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        xgr = xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.accepted = 0

    def allowed(self) -> torch.Tensor:
        """Which tokens the grammar allows next: a bool tensor [vocab_size] (on the CPU)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = (self.bitmask[0].unsqueeze(1) >> _SHIFTS) & 1
        return bits.flatten()[:self.vocab_size].bool()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """One row of logits [V] with the tokens the grammar does not allow next at -inf (a new fp32
        tensor; the others keep their bits). LogitsControlError when it allows none."""
        allowed = self.allowed().to(logits.device)
        if not bool(allowed.any()):
            raise LogitsControlError("the structured output's grammar allows no token here")
        row = logits.float().clone()
        row.masked_fill_(~allowed, float("-inf"))
        return row

    def advance(self, tokens: Sequence[int]) -> bool:
        """Feed the matcher the tokens of `tokens` (the request's output so far) it has not taken;
        False if it refuses one (a token its mask did not allow)."""
        for token in tokens[self.accepted:]:
            if not self.matcher.accept_token(token):
                return False
            self.accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has taken its stop token (EOS): the request ends."""
        return bool(self.matcher.is_terminated())

