"""The TokTier error hierarchy: one base class, mixed with builtins where natural.

Local misuse (bad arguments) and missing data raise these; the sidecar maps each
class to a typed error frame and the client re-raises the same class.
"""

from __future__ import annotations


class TokTierError(Exception):
    """Base class of every error TokTier raises on purpose."""


class UnknownTokenizer(TokTierError, KeyError):
    """A tokenizer name, path or hash that is not known.  The message lists what exists."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class TokenizerDataMissing(TokTierError, FileNotFoundError):
    """A bundled tokenizer whose reference file is not installed (the message says how to get it)."""


class UnsupportedTokenizer(TokTierError, ValueError):
    """A tokenizer file TokTier cannot load at all (not a tokenizer.json / tiktoken rank file)."""


class InvalidEditRange(TokTierError, ValueError):
    """An edit whose [start, end) is outside the session text or reversed."""


class InvalidText(TokTierError, ValueError):
    """Text that is not a valid Unicode string (e.g. lone surrogates cannot be UTF-8 encoded)."""


class InvalidState(TokTierError, ValueError):
    """A `(text, ids)` state that is not the reference encoding (or whose certificate is corrupt)."""


class ReferenceEngineError(TokTierError, RuntimeError):
    """The reference engine itself failed (raised or panicked) on a text or a file.

    TokTier has no answer where its reference has none: the message names the
    engine's own error.
    """


class InvalidCacheConfig(TokTierError, ValueError):
    """A `PrefixCache` argument out of range (the message names it and the accepted values)."""


class ChatTemplateMissing(TokTierError, LookupError):
    """No chat template for this tokenizer, or its file is not fetched (the message says how to get one)."""


class ChatTemplateError(TokTierError, ValueError):
    """A chat template that does not compile, or that raised while rendering (the message carries the template's)."""


class InvalidChatInput(TokTierError, ValueError):
    """Messages, tools, documents or render options a chat template cannot be given (the message names which)."""


class InvalidConversationOp(TokTierError, ValueError):
    """A `Conversation` op that cannot apply to its current state (rollback past its length,
    sampled IDs with no message to continue, ...); the message says what the state allows."""


class InvalidTokenIds(TokTierError, ValueError):
    """Token IDs that are not a 1-D sequence of integers within the tokenizer's vocabulary."""


class JunctionUnavailable(TokTierError, ValueError):
    """A chat template that gives sampled IDs no single place to stand (the generated turn is not
    rendered exactly once where its content goes), so token-in-token-out cannot be defined for it."""
