"""Real text for differential tokenizer tests and benchmarks.

This module owns the test/benchmark corpus: text taken from files that installed packages ship
(CPython's stdlib sources, ``pydoc_data`` topics, ``test/cjkencodings``, C headers, dist-info
``RECORD``/``METADATA`` files, Faker locale word lists, the ``emoji`` package's data), arranged into
named samples per category (:func:`samples`), long benchmark texts of an exact length
(:func:`large_text`), chat-template wrapping with the special-token literals of a tokenizer
family (:func:`chat_wrap`), and the alphabet of adversarial atoms that generated test texts are
drawn from (:data:`ADVERSARIAL_ATOMS`).  It is tooling: the library never imports it, and Faker and
emoji come with the ``tools`` extra.

It is pure: no network, no global mutable state, everything deterministic given ``seed`` (and the
installed packages).  Heavy sources (Faker, emoji, pydoc topics) are imported lazily; loaders are
memoised with ``functools.lru_cache`` and return immutable values only.  Optional sources that a
Python build may lack (``test/cjkencodings``, ``test/decimaltestdata``, C headers) are skipped,
never fatal.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ADVERSARIAL_ATOMS",
    "CATEGORIES",
    "CHAT_FAMILIES",
    "LARGE_KINDS",
    "Sample",
    "chat_wrap",
    "large_text",
    "samples",
]

# Adversarial atoms for generated text, chosen to sit on every boundary rule of every
# family (digit runs, whitespace kinds incl. CR|LF, contractions, case changes, marks and
# NFC pairs, kana with DeepSeek's in-class punctuation, emoji sequences, controls, and
# added-token literals, overlapping literals and their fragments).  Used by the tests and
# by `toktier verify --adversarial`.
ADVERSARIAL_ATOMS = (
    "a", "b", "Z", "Q", "é", "ß", "Ω", "ж", "Я", "م", "ر", "\u064e", "\u0651", "中", "文", "あ", "ア",
    "・", "ー", "゛", "\u3099", "한", "ǅ", "ʰ",
    "e\u0301", "\u0301", "\u0327", "A\u030a", "\u1100\u1161", "\u11a8", "Å",
    "0", "1", "7", "9", "١", "٣", "０", "½", "²", "Ⅻ", "12345",
    " ", "  ", "\t", "\n", "\r", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c", "\x85",
    "'", "'s", "'S", "'ll", "'VE", "'d", "\"", "/", ".", ",", "!", "?", "-", "_", "(", ")", "{", "}",
    "<", ">", "|", "=", "#", "$", "。", "，", "、", "？", "«", "—", "…", "€", "©", "+", "*",
    "Hello", "hello", "WORLD", "camelCase", "HTTPServer", "def", "self.x", "0x1F", "ID", "iPhone",
    "😀", "👨\u200d👩\u200d👧", "\u200d", "\ufe0f", "🇺🇸", "👍🏽",
    "\x00", "\x1f", "\x7f",
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|", "|>", "<|im_",
    "start|>", "<|begin_of_text|>", "<|eot_id|>", "<｜User｜>", "<｜Assistant｜>", "<｜", "｜>",
    "<tool_call>", "<|endofprompt|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>",
    "<|endoftext|><|endoftext|>", "<|im_start|>user\n", "<|fim_prefix|>",
)

CATEGORIES = ("code", "english", "cjk", "arabic", "cyrillic", "emoji", "crlf", "json", "logs", "mixed")
LARGE_KINDS = ("code", "english", "mixed", "multilingual")
CHAT_FAMILIES = ("chatml", "llama3", "deepseek")

# Synthetic (Faker/log/emoji-chat) samples are generated up to this many characters even when a
# caller allows more per sample; file-backed samples are only bounded by ``max_chars_per_sample``.
_GENERATED_CAP = 262_144
# Per-sample budget of the material that large_text("mixed"/"multilingual") repeats and reshuffles.
_POOL_SAMPLE_CHARS = 65_536
_POOL_CHUNK = 2_048

_CODE_MODULES = (
    "asyncio", "json", "email", "collections", "re", "argparse", "dataclasses", "typing",
    "textwrap", "difflib", "tokenize", "pathlib", "functools", "inspect", "ast", "string",
    "csv", "http.server", "unittest.mock", "logging", "concurrent.futures", "importlib.metadata",
    "sqlite3", "xml.etree.ElementTree", "urllib.parse", "shutil", "subprocess", "tarfile",
)

# (locale, Faker method) recipes, used round-robin so every prefix mixes all entries.
_ARABIC = (
    ("ar_AA", "paragraph"), ("ar_AA", "name"), ("ar_DZ", "address"), ("ar_AA", "job"),
    ("ar_SA", "company"), ("ar_AA", "sentence"), ("ar_PS", "name"), ("ar_DZ", "city"),
)
_PERSIAN = (("fa_IR", "paragraph"), ("fa_IR", "name"), ("fa_IR", "address"), ("fa_IR", "job"))
_CYRILLIC = (
    ("ru_RU", "paragraph"), ("ru_RU", "name"), ("ru_RU", "address"), ("ru_RU", "job"),
    ("uk_UA", "paragraph"), ("uk_UA", "name"), ("bg_BG", "name"), ("ru_RU", "company"),
    ("mk_MK", "paragraph"), ("uk_UA", "address"),
)
_CJK = (
    ("zh_CN", "paragraph"), ("ja_JP", "paragraph"), ("ko_KR", "address"), ("zh_TW", "paragraph"),
    ("zh_CN", "address"), ("ja_JP", "name"), ("ko_KR", "name"), ("ja_JP", "address"),
    ("zh_CN", "company"), ("ko_KR", "company"),
)
_MULTILINGUAL = (
    ("he_IL", "paragraph"), ("el_GR", "paragraph"), ("hi_IN", "address"), ("th_TH", "paragraph"),
    ("hy_AM", "paragraph"), ("ka_GE", "address"), ("bn_BD", "paragraph"), ("vi_VN", "paragraph"),
    ("hi_IN", "name"), ("ta_IN", "address"), ("de_DE", "paragraph"), ("fr_FR", "paragraph"),
    ("pl_PL", "paragraph"), ("tr_TR", "address"), ("am_ET", "address"), ("cs_CZ", "paragraph"),
    ("he_IL", "address"), ("el_GR", "address"), ("th_TH", "address"), ("ne_NP", "address"),
)


@dataclass(frozen=True)
class Sample:
    """One named piece of real text: ``name`` is "<category>/<source>"."""

    name: str
    category: str
    text: str


# --------------------------------------------------------------------------------------------
# loaders (pure; memoised; immutable results)
# --------------------------------------------------------------------------------------------


def _read(path: str) -> str:
    """A text file as UTF-8, line endings preserved, invalid bytes replaced."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read()


def _clean(text: str) -> str:
    """Drop anything UTF-8 cannot encode (lone surrogates) so every text is a valid str."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


@functools.lru_cache(maxsize=1)
def _stdlib_dir() -> str | None:
    path = sysconfig.get_paths().get("stdlib")
    return path if path and os.path.isdir(path) else None


@functools.lru_cache(maxsize=1)
def _python_sources() -> tuple[tuple[str, str], ...]:
    """(path, source) of the stdlib modules/packages in ``_CODE_MODULES`` (top-level files)."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for mod in _CODE_MODULES:
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        if spec.submodule_search_locations:
            pkg_dir = os.path.dirname(spec.origin)
            paths = [os.path.join(pkg_dir, n) for n in sorted(os.listdir(pkg_dir)) if n.endswith(".py")]
        else:
            paths = [spec.origin]
        for p in paths:
            if p in seen or not os.path.isfile(p):
                continue
            seen.add(p)
            text = _clean(_read(p))
            if text.strip():
                out.append((p, text))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _c_sources() -> tuple[tuple[str, str], ...]:
    """(path, text) of C headers: CPython's include dir, else numpy's bundled headers."""
    dirs = []
    inc = sysconfig.get_paths().get("include")
    if inc:
        dirs.append(inc)
    spec = importlib.util.find_spec("numpy")
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            dirs += [os.path.join(loc, "_core", "include", "numpy"), os.path.join(loc, "core", "include", "numpy")]
    for d in dirs:
        if not os.path.isdir(d):
            continue
        files = [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".h")]
        out = tuple((p, _clean(_read(p))) for p in files if os.path.isfile(p))
        if out:
            return out
    return ()


@functools.lru_cache(maxsize=1)
def _pydoc_topics() -> tuple[str, ...]:
    """The English prose of ``pydoc_data.topics`` (the Python reference manual), sorted by topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        return ()
    return tuple(_clean(topics[k]) for k in sorted(topics))


@functools.lru_cache(maxsize=1)
def _license_text() -> str:
    d = _stdlib_dir()
    path = os.path.join(d, "LICENSE.txt") if d else ""
    return _clean(_read(path)) if path and os.path.isfile(path) else ""


@functools.lru_cache(maxsize=1)
def _cjk_files() -> tuple[tuple[str, str], ...]:
    """(encoding, text) of CPython's ``test/cjkencodings/*-utf8.txt`` (empty if not installed)."""
    d = _stdlib_dir()
    cjk_dir = os.path.join(d, "test", "cjkencodings") if d else ""
    if not cjk_dir or not os.path.isdir(cjk_dir):
        return ()
    out = []
    for n in sorted(os.listdir(cjk_dir)):
        if n.endswith("-utf8.txt"):
            text = _clean(_read(os.path.join(cjk_dir, n)))
            if text.strip():
                out.append((n[: -len("-utf8.txt")], text))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _decimal_tests() -> tuple[tuple[str, str], ...]:
    """(name, text) of CPython's ``test/decimaltestdata/*.decTest`` files that use CRLF."""
    d = _stdlib_dir()
    dec_dir = os.path.join(d, "test", "decimaltestdata") if d else ""
    if not dec_dir or not os.path.isdir(dec_dir):
        return ()
    out = []
    for n in sorted(os.listdir(dec_dir)):
        if n.endswith(".decTest"):
            text = _clean(_read(os.path.join(dec_dir, n)))
            if "\r\n" in text:
                out.append((n, text))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _distributions() -> tuple:
    """Installed distributions, one per normalised name, sorted by name."""
    import importlib.metadata as md

    by_name = {}
    for dist in md.distributions():
        try:
            name = (dist.metadata.get("Name") or "").strip()
        except Exception:  # a broken dist-info directory: skip it
            continue
        key = name.lower().replace("_", "-")
        if name and key not in by_name:
            by_name[key] = dist
    return tuple(by_name[k] for k in sorted(by_name))


@functools.lru_cache(maxsize=1)
def _dist_records() -> tuple[tuple[str, str], ...]:
    """(name, RECORD text) of installed distributions; pip writes RECORD as CSV with CRLF."""
    out = []
    for dist in _distributions():
        # Distribution.read_text translates newlines, so locate the file and read it raw.
        for f in dist.files or ():
            if f.name == "RECORD" and f.parent.name.endswith(".dist-info"):
                path = str(f.locate())
                if os.path.isfile(path):
                    text = _clean(_read(path))
                    if "\r\n" in text:
                        out.append((dist.metadata["Name"], text))
                break
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _dist_metadata_json() -> tuple[str, ...]:
    """One compact JSON document per installed distribution (real metadata, files, entry points)."""
    out = []
    for dist in _distributions():
        meta = dist.metadata
        body = meta.get_payload() if hasattr(meta, "get_payload") else None
        if not isinstance(body, str) or not body.strip():
            body = meta.get("Description") or ""
        files = []
        for f in (dist.files or [])[:16]:
            files.append({
                "path": str(f),
                "hash": f"{f.hash.mode}={f.hash.value}" if f.hash else None,
                "size": f.size,
            })
        record = {
            "name": meta.get("Name"),
            "version": meta.get("Version"),
            "summary": meta.get("Summary"),
            "requires_python": meta.get("Requires-Python"),
            "license": meta.get("License"),
            "home_page": meta.get("Home-page"),
            "project_urls": meta.get_all("Project-URL") or [],
            "classifiers": meta.get_all("Classifier") or [],
            "requires": list(dist.requires or []),
            "entry_points": [
                {"group": ep.group, "name": ep.name, "value": ep.value} for ep in dist.entry_points
            ],
            "files": files,
            "description": _clean(body[:1500]),
        }
        out.append(json.dumps(record, ensure_ascii=False, sort_keys=False))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _emoji_entries() -> tuple[tuple[str, str], ...]:
    """(emoji, English shortcode) from ``emoji.EMOJI_DATA``, in the package's own order."""
    import emoji

    return tuple((k, v.get("en", "")) for k, v in emoji.EMOJI_DATA.items())


@functools.lru_cache(maxsize=16)
def _emoji_i18n(lang: str) -> str:
    """The raw ``emoji/unicode_codes/emoji_<lang>.json`` file shipped by the emoji package."""
    spec = importlib.util.find_spec("emoji")
    if spec is None or not spec.submodule_search_locations:
        return ""
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, "unicode_codes", f"emoji_{lang}.json")
        if os.path.isfile(path):
            return _clean(_read(path))
    return ""


def _emoji_names(langs: tuple[str, ...]) -> str:
    """Lines "<emoji> <localised name>" from the emoji package's translations."""
    lines = []
    tables = []
    for lang in langs:
        raw = _emoji_i18n(lang)
        if raw:
            tables.append(json.loads(raw))
    if not tables:
        return ""
    for key in tables[0]:
        for t in tables:
            if key in t:
                lines.append(f"{key} {t[key].strip(':').replace('_', ' ')}")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=64)
def _faker_text(recipe: tuple[tuple[str, str], ...], seed: int, n_chars: int) -> str:
    """Deterministic Faker text of at least ``n_chars`` (unless Faker yields nothing)."""
    from faker import Faker

    fakers = {}
    for loc, _ in recipe:
        if loc not in fakers:
            fk = Faker(loc)
            fk.seed_instance(seed)
            fakers[loc] = fk
    parts: list[str] = []
    total = 0
    misses = 0
    i = 0
    while total < n_chars and misses < 4 * len(recipe):
        loc, method = recipe[i % len(recipe)]
        i += 1
        try:
            value = getattr(fakers[loc], method)()
        except AttributeError:
            value = ""
        value = _clean(str(value))
        if not value.strip():
            misses += 1
            continue
        sep = "\n\n" if method == "paragraph" else "\n"
        parts.append(value + sep)
        total += len(value) + len(sep)
    return "".join(parts)


# --------------------------------------------------------------------------------------------
# builders (one per category)
# --------------------------------------------------------------------------------------------


def _take(pieces, rng: random.Random, n_chars: int, sep: str = "") -> str:
    """Concatenate ``pieces`` in a seeded order until at least ``n_chars`` (one pass at most)."""
    order = list(range(len(pieces)))
    rng.shuffle(order)
    out: list[str] = []
    total = 0
    for i in order:
        out.append(pieces[i])
        total += len(pieces[i]) + len(sep)
        if total >= n_chars:
            break
    return sep.join(out)


def _code_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    rng = random.Random(f"code:{seed}")
    out = []
    py = _python_sources()
    if py:
        out.append(("code/python-stdlib", _take([t for _, t in py], rng, limit)))
    c = _c_sources()
    if c:
        out.append(("code/c-headers", _take([t for _, t in c], rng, limit)))
    makefile = sysconfig.get_makefile_filename() if hasattr(sysconfig, "get_makefile_filename") else ""
    if makefile and os.path.isfile(makefile):
        out.append(("code/makefile", _clean(_read(makefile))))
    return out


def _english_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    rng = random.Random(f"english:{seed}")
    out = []
    topics = _pydoc_topics()
    if topics:
        out.append(("english/pydoc-topics", _take(topics, rng, limit, sep="\n")))
    lic = _license_text()
    if lic:
        out.append(("english/python-license", lic))
    if not out:  # pragma: no cover - no pydoc_data and no LICENSE: fall back to docstrings
        out.append(("english/faker-en_US", _faker_text((("en_US", "paragraph"),), seed, min(limit, _GENERATED_CAP))))
    return out


def _cjk_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    out = [(f"cjk/{enc}", text) for enc, text in _cjk_files()]
    out.append(("cjk/faker", _faker_text(_CJK, seed, min(limit, _GENERATED_CAP))))
    names = _emoji_names(("zh", "ja", "ko"))
    if names:
        out.append(("cjk/emoji-names", names))
    return out


def _arabic_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    out = [
        ("arabic/faker", _faker_text(_ARABIC, seed, min(limit, _GENERATED_CAP))),
        ("arabic/faker-fa_IR", _faker_text(_PERSIAN, seed, min(limit, _GENERATED_CAP))),
    ]
    names = _emoji_names(("ar", "fa"))
    if names:
        out.append(("arabic/emoji-names", names))
    return out


def _cyrillic_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    out = [("cyrillic/faker", _faker_text(_CYRILLIC, seed, min(limit, _GENERATED_CAP)))]
    names = _emoji_names(("ru",))
    if names:
        out.append(("cyrillic/emoji-names", names))
    return out


def _emoji_buckets(rng: random.Random) -> list[list[tuple[str, str]]]:
    zwj, skin, flags, keycap, vs16, plain = [], [], [], [], [], []
    for e, name in _emoji_entries():
        if "\u200d" in e:
            zwj.append((e, name))
        elif any(0x1F3FB <= ord(ch) <= 0x1F3FF for ch in e):
            skin.append((e, name))
        elif any(0x1F1E6 <= ord(ch) <= 0x1F1FF or 0xE0020 <= ord(ch) <= 0xE007F for ch in e):
            flags.append((e, name))
        elif "\u20e3" in e:
            keycap.append((e, name))
        elif "\ufe0f" in e:
            vs16.append((e, name))
        else:
            plain.append((e, name))
    buckets = [b for b in (zwj, skin, flags, keycap, vs16, plain) if b]
    for b in buckets:
        rng.shuffle(b)
    return buckets


def _emoji_sequences(seed: int, limit: int) -> str:
    """Every emoji once, round-robin over kinds (ZWJ, skin tone, flag, keycap, VS16, plain)."""
    rng = random.Random(f"emoji-seq:{seed}")
    buckets = _emoji_buckets(rng)
    order: list[str] = []
    for i in range(max(len(b) for b in buckets)):
        for b in buckets:
            if i < len(b):
                order.append(b[i][0])
    seps = (" ", " ", " ", "\n", ", ", "", " | ")
    out: list[str] = []
    total = 0
    pos = 0
    while pos < len(order) and total < limit:
        k = rng.randint(1, 4)
        run = "".join(order[pos: pos + k]) + rng.choice(seps)
        pos += k
        out.append(run)
        total += len(run)
    return "".join(out)


def _emoji_chat(seed: int, limit: int) -> str:
    """English sentences with emoji and :shortcodes: attached the way chat users write them."""
    rng = random.Random(f"emoji-chat:{seed}")
    buckets = _emoji_buckets(rng)
    flat = [e for b in buckets for e in b]
    zwj = buckets[0]
    lines = [ln for t in _pydoc_topics() for ln in t.split("\n") if len(ln.split()) >= 4]
    if not lines:
        lines = ["the quick brown fox jumps over the lazy dog"]
    out: list[str] = []
    total = 0
    i = 0
    while total < limit and i < 20_000:
        words = lines[rng.randrange(len(lines))].split()
        source = zwj if i % 3 == 0 else flat  # keep ZWJ sequences frequent
        e, name = source[rng.randrange(len(source))]
        at = rng.randrange(len(words) + 1)
        style = rng.randrange(4)
        if style == 0:
            words.insert(at, e)
        elif style == 1:
            words.insert(at, e * rng.randint(2, 3))
        elif style == 2 and name:
            words.insert(at, name)
        else:
            words[at - 1 if at else 0] += e
        line = " ".join(words) + rng.choice(("\n", "\n", " ", "\n\n"))
        out.append(line)
        total += len(line)
        i += 1
    return "".join(out)


def _emoji_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    return [
        ("emoji/sequences", _emoji_sequences(seed, limit)),
        ("emoji/chat", _emoji_chat(seed, min(limit, _GENERATED_CAP))),
    ]


def _crlf_converted(seed: int, limit: int) -> str:
    """Real text with CRLF endings, plus lone CR (progress bars), CR CR LF and LF CR oddities."""
    rng = random.Random(f"crlf:{seed}")
    topics = _pydoc_topics() or (_license_text(),)
    dists = [(d.metadata["Name"], d.metadata["Version"]) for d in _distributions()] or [("toktier", "0.1.0")]
    out: list[str] = []
    total = 0
    i = 0
    while total < limit and i < 200_000:
        i += 1
        if i % 9 == 1:  # a progress bar redrawn with lone CR, finished with CRLF
            name, ver = dists[rng.randrange(len(dists))]
            steps = sorted(rng.sample(range(1, 100), rng.randint(2, 6))) + [100]
            bar = "".join(f"Downloading {name}-{ver} {p:3d}%\r" for p in steps[:-1])
            piece = bar + f"Downloading {name}-{ver} 100%\r\n"
        else:
            text = topics[rng.randrange(len(topics))]
            lines = text.split("\n")
            start = rng.randrange(len(lines))
            chunk = lines[start: start + rng.randint(1, 12)]
            ending = "\r\r\n" if i % 23 == 5 else ("\n\r" if i % 29 == 7 else "\r\n")
            piece = "\r\n".join(chunk) + ending
        out.append(piece)
        total += len(piece)
    return "".join(out)


def _crlf_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    rng = random.Random(f"crlf-files:{seed}")
    out = [("crlf/converted", _crlf_converted(seed, min(limit, _GENERATED_CAP)))]
    records = _dist_records()
    if records:
        out.append(("crlf/dist-record", _take([t for _, t in records], rng, limit)))
    dec = _decimal_tests()
    if dec:
        out.append(("crlf/decimaltest", _take([t for _, t in dec], rng, limit)))
    return out


def _json_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    rng = random.Random(f"json:{seed}")
    docs = list(_dist_metadata_json())
    rng.shuffle(docs)
    out = []
    if docs:
        records = []
        total = 0
        for d in docs:
            records.append(json.loads(d))
            total += len(d) * 2  # pretty-printing roughly doubles the size
            if total >= limit:
                break
        tool_result = {
            "type": "tool_result",
            "tool_use_id": f"toolu_{rng.getrandbits(96):024x}",
            "is_error": False,
            "content": [{"type": "json", "json": {"packages": records, "count": len(records)}}],
        }
        out.append(("json/package-metadata", json.dumps(tool_result, indent=2, ensure_ascii=False) + "\n"))
        out.append(("json/jsonl-compact", _take([d + "\n" for d in docs], rng, limit)))
    parts = []
    for lang in ("zh", "ar", "ru", "ja", "ko", "fa"):
        raw = _emoji_i18n(lang)
        if raw:
            parts.append(raw[: max(1, limit // 12)])
            table = json.loads(raw)
            subset = dict(list(table.items())[: 200])
            parts.append(json.dumps(subset, ensure_ascii=True, indent=1)[: max(1, limit // 12)] + "\n")
    if parts:
        out.append(("json/emoji-i18n", "".join(parts)))
    if not out:  # pragma: no cover - nothing installed with metadata
        out.append(("json/stdlib-modules", json.dumps(sorted(sys.stdlib_module_names), indent=2)))
    return out


@functools.lru_cache(maxsize=1)
def _source_lines() -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((p, tuple(t.split("\n"))) for p, t in _python_sources())


def _logs_text(seed: int, limit: int) -> str:
    """Application, access, warning, traceback and debug log lines built from real names/paths."""
    import datetime as _dt

    rng = random.Random(f"logs:{seed}")
    modules = sorted(m for m in sys.stdlib_module_names if not m.startswith("_"))
    dists = [(d.metadata["Name"], d.metadata["Version"]) for d in _distributions()] or [("toktier", "0.1.0")]
    sources = _source_lines()
    py_ver = "%d.%d.%d" % sys.version_info[:3]
    t = _dt.datetime(2024, 5, 17, 3, 14, 15, tzinfo=_dt.timezone.utc) + _dt.timedelta(seconds=seed % 86_400)
    hosts = ("gpu-node-07", "gpu-node-12", "edge-a3", "tok-sidecar-0")
    levels = ("INFO", "INFO", "INFO", "DEBUG", "DEBUG", "WARNING", "ERROR")
    excs = (
        "ValueError: invalid literal for int() with base 10: '0x1f'",
        "KeyError: 'session_id'",
        "TimeoutError: [Errno 110] Connection timed out",
        "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe2 in position 4095: unexpected end of data",
        "json.decoder.JSONDecodeError: Expecting ',' delimiter: line 1 column 8193 (char 8192)",
        "ConnectionResetError: [Errno 104] Connection reset by peer",
    )

    def src_line():
        path, lines = sources[rng.randrange(len(sources))]
        idx = rng.randrange(len(lines))
        func = "<module>"
        for j in range(idx, -1, -1):
            s = lines[j].lstrip()
            if s.startswith(("def ", "async def ")):
                func = s.split("def ", 1)[1].split("(", 1)[0]
                break
        return path, idx + 1, func, lines[idx].strip()

    out: list[str] = []
    total = 0
    n = 0
    while total < limit and n < 500_000:
        n += 1
        t += _dt.timedelta(microseconds=rng.randrange(50, 2_500_000))
        ts = t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        kind = rng.randrange(10)
        pid = rng.randrange(1000, 65000)
        if kind < 3 or not sources:
            mod = modules[rng.randrange(len(modules))]
            lvl = levels[rng.randrange(len(levels))]
            line = (
                f"{ts} {lvl:<7} {mod} [pid={pid} tid={rng.getrandbits(47):d}] "
                f"request_id={rng.getrandbits(64):016x} session={rng.getrandbits(32):08x} "
                f"tokens={rng.randrange(1, 200_000)} elapsed_ms={rng.random() * 250:.3f}\n"
            )
        elif kind < 5:
            name, ver = dists[rng.randrange(len(dists))]
            ip = ".".join(str(rng.randrange(1, 255)) for _ in range(4))
            method = ("GET", "GET", "POST", "PUT", "DELETE")[rng.randrange(5)]
            status = (200, 200, 200, 201, 204, 304, 404, 429, 500, 503)[rng.randrange(10)]
            line = (
                f'{ip} - - [{t.strftime("%d/%b/%Y:%H:%M:%S +0000")}] "{method} /simple/{name.lower()}/'
                f'{name}-{ver}.tar.gz HTTP/1.1" {status} {rng.randrange(0, 9_999_999)} "-" '
                f'"pip/24.0 {{"python":"{py_ver}","implementation":{{"name":"CPython"}}}}" {rng.random():.4f}\n'
            )
        elif kind < 7:
            path, lineno, func, code = src_line()
            cat = ("DeprecationWarning", "ResourceWarning", "RuntimeWarning", "UserWarning")[rng.randrange(4)]
            line = f"{ts} WARNING py.warnings: {path}:{lineno}: {cat}: in {func}()\n  {code}\n"
        elif kind < 8:
            frames = [src_line() for _ in range(rng.randint(2, 6))]
            tb = "".join(f'  File "{p}", line {ln}, in {f}\n    {c}\n' for p, ln, f, c in frames)
            line = (
                f"{ts} ERROR   {hosts[rng.randrange(len(hosts))]} worker-{rng.randrange(16)} "
                f"Unhandled exception in task Task-{rng.randrange(100_000)}\n"
                f"Traceback (most recent call last):\n{tb}{excs[rng.randrange(len(excs))]}\n"
            )
        elif kind < 9:
            line = (
                f"{ts} DEBUG   toktier.shm arena=0x{0x7F0000000000 + rng.getrandbits(36):x} "
                f"off=0x{rng.getrandbits(20):08x} len={rng.choice((4096, 65536, 1 << 20))} "
                f"crc32=0x{rng.getrandbits(32):08x} sha256={rng.getrandbits(256):064x}\n"
            )
        else:
            up = (t - _dt.datetime(2024, 5, 17, tzinfo=_dt.timezone.utc)).total_seconds()
            line = (
                f"{t.strftime('%b %d %H:%M:%S')} {hosts[rng.randrange(len(hosts))]} kernel: "
                f"[{up:12.6f}] python{sys.version_info[0]}.{sys.version_info[1]}[{pid}]: segfault at "
                f"{rng.getrandbits(40):x} ip {rng.getrandbits(47):016x} sp {rng.getrandbits(47):016x} "
                f"error 4 in libpython{sys.version_info[0]}.{sys.version_info[1]}.so.1.0\n"
            )
        out.append(line)
        total += len(line)
    return "".join(out)


def _logs_samples(seed: int, limit: int) -> list[tuple[str, str]]:
    return [("logs/mixed-app", _logs_text(seed, min(limit, _GENERATED_CAP)))]


def _markdown_answer(seed: int, limit: int) -> str:
    """An assistant-style answer: prose, fenced stdlib code, a JSON block, emoji, CJK quote."""
    rng = random.Random(f"markdown:{seed}")
    topics = _pydoc_topics() or (_license_text() or "text",)
    sources = _source_lines()
    docs = _dist_metadata_json()
    cjk = [t for _, t in _cjk_files()] or [_faker_text(_CJK, seed, 2000)]
    emo = [e for e, _ in _emoji_entries()]
    out: list[str] = []
    total = 0
    i = 0
    while total < limit and i < 100_000:
        i += 1
        k = i % 5
        if k == 0 or not sources:
            paras = [p for p in topics[rng.randrange(len(topics))].split("\n\n") if p.strip()]
            piece = (paras[rng.randrange(len(paras))] if paras else "") + "\n\n"
        elif k == 1:
            path, lines = sources[rng.randrange(len(sources))]
            start = rng.randrange(len(lines))
            code = "\n".join(lines[start: start + rng.randint(3, 40)])
            piece = f"In `{os.path.basename(path)}`:\n\n```python\n{code}\n```\n\n"
        elif k == 2 and docs:
            piece = "```json\n" + json.dumps(json.loads(docs[rng.randrange(len(docs))]), indent=2, ensure_ascii=False)[:1500] + "\n```\n\n"
        elif k == 3:
            piece = "> " + cjk[rng.randrange(len(cjk))].strip().split("\n")[0] + "\n\n"
        else:
            piece = "- " + " ".join(emo[rng.randrange(len(emo))] for _ in range(rng.randint(1, 5))) + " done\n\n"
        out.append(piece)
        total += len(piece)
    return "".join(out)


def _mixed_samples(seed: int, limit: int, others: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """Interleave chunks of every other category's samples, plus multilingual and markdown text."""
    rng = random.Random(f"mixed:{seed}")
    by_cat: dict[str, list[str]] = {}
    for _, cat, text in others:
        by_cat.setdefault(cat, []).append(text)
    cats = [c for c in CATEGORIES if c in by_cat]
    offsets = {c: 0 for c in cats}
    out: list[str] = []
    total = 0
    cap = min(limit, _GENERATED_CAP)
    i = 0
    while total < cap and cats:
        cat = cats[i % len(cats)]
        i += 1
        texts = by_cat[cat]
        text = texts[(i // len(cats)) % len(texts)]
        size = rng.randint(80, 1200)
        off = offsets[cat] % max(1, len(text))
        piece = text[off: off + size]
        offsets[cat] = off + size
        if piece:
            out.append(piece)
            total += len(piece)
    return [
        ("mixed/interleaved", "".join(out)),
        ("mixed/multilingual", _faker_text(_MULTILINGUAL, seed, min(limit, _GENERATED_CAP))),
        ("mixed/markdown-answer", _markdown_answer(seed, min(limit, _GENERATED_CAP))),
    ]


@functools.lru_cache(maxsize=8)
def _samples(max_chars: int, seed: int) -> tuple[Sample, ...]:
    builders = (
        ("code", _code_samples), ("english", _english_samples), ("cjk", _cjk_samples),
        ("arabic", _arabic_samples), ("cyrillic", _cyrillic_samples), ("emoji", _emoji_samples),
        ("crlf", _crlf_samples), ("json", _json_samples), ("logs", _logs_samples),
    )
    made: list[tuple[str, str, str]] = []
    for cat, build in builders:
        for name, text in build(seed, max_chars):
            text = _clean(text)[:max_chars]
            if text:
                made.append((name, cat, text))
    for name, text in _mixed_samples(seed, max_chars, made):
        text = _clean(text)[:max_chars]
        if text:
            made.append((name, "mixed", text))
    return tuple(Sample(name, cat, text) for name, cat, text in made)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def samples(max_chars_per_sample: int = 200_000, seed: int = 0) -> list[Sample]:
    """Named samples of real text, at least one per category in :data:`CATEGORIES`.

    Deterministic for a given ``seed`` and set of installed packages.  Each text is non-empty,
    at most ``max_chars_per_sample`` characters, and encodes to UTF-8.  Generated samples (Faker,
    logs, emoji chat, CRLF conversion, mixed) stop at about 256K characters.
    """
    if max_chars_per_sample < 1:
        raise ValueError(f"max_chars_per_sample must be >= 1, got {max_chars_per_sample}")
    return list(_samples(int(max_chars_per_sample), int(seed)))


def _split_chunks(text: str, size: int) -> list[str]:
    """Split at line ends into pieces of roughly ``size`` characters (concatenation == text)."""
    out = []
    start = 0
    n = len(text)
    while start < n:
        end = min(n, start + size)
        if end < n:
            nl = text.find("\n", end, end + size)
            if nl >= 0:
                end = nl + 1
        out.append(text[start:end])
        start = end
    return out


@functools.lru_cache(maxsize=16)
def _pool(kind: str, seed: int) -> tuple[str, ...]:
    """The pieces that large_text(kind) reshuffles and repeats."""
    if kind == "code":
        texts = [t for _, t in _python_sources()] + [t for _, t in _c_sources()]
    elif kind == "english":
        texts = list(_pydoc_topics()) + [_license_text()]
    else:
        base = _samples(_POOL_SAMPLE_CHARS, seed)
        if kind == "multilingual":
            keep = {"english", "cjk", "arabic", "cyrillic"}
            texts = [s.text for s in base if s.category in keep or s.name == "mixed/multilingual"]
        else:
            texts = [s.text for s in base]
    pieces = [p for t in texts if t for p in _split_chunks(t, _POOL_CHUNK)]
    if not pieces:  # pragma: no cover - only if every source is missing
        raise RuntimeError(f"no material for large_text kind {kind!r}")
    return tuple(pieces)


def large_text(n_chars: int, seed: int = 0, kind: str = "mixed") -> str:
    """Exactly ``n_chars`` characters of real material, concatenated in a seeded order.

    ``kind`` is one of :data:`LARGE_KINDS`.  When the material is shorter than ``n_chars`` it is
    reused, reshuffled each round, so long texts are not periodic.
    """
    if kind not in LARGE_KINDS:
        raise ValueError(f"kind must be one of {LARGE_KINDS}, got {kind!r}")
    if n_chars < 0:
        raise ValueError(f"n_chars must be >= 0, got {n_chars}")
    if n_chars == 0:
        return ""
    pool = _pool(kind, int(seed))
    rng = random.Random(f"large:{kind}:{seed}")
    parts: list[str] = []
    total = 0
    order = list(range(len(pool)))
    while total < n_chars:
        rng.shuffle(order)
        for i in order:
            parts.append(pool[i])
            total += len(pool[i])
            if total >= n_chars:
                break
    text = "".join(parts)
    return text[:n_chars]


# (prefix, per-turn format, generation prompt) of the families rendered by a plain format string.
_CHATML = ("", "<|im_start|>{role}\n{content}<|im_end|>\n", "<|im_start|>assistant\n")
_LLAMA3 = (
    "<|begin_of_text|>",
    "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>",
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
)


def chat_wrap(
    turns: list[tuple[str, str]],
    specials: Literal["chatml", "llama3", "deepseek"],
    add_generation_prompt: bool = False,
) -> str:
    """Render ``(role, content)`` turns with the chat template literals of a tokenizer family.

    - chatml (Qwen and others): ``<|im_start|>role\\ncontent<|im_end|>\\n`` per turn.
    - llama3: ``<|begin_of_text|>`` then ``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>``.
    - deepseek (V3/R1): ``<｜begin▁of▁sentence｜>`` + system text, ``<｜User｜>content``,
      ``<｜Assistant｜>content<｜end▁of▁sentence｜>``, tool turns in
      ``<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>…<｜tool▁output▁end｜><｜tool▁outputs▁end｜>``.

    ``add_generation_prompt`` appends the opening of an assistant turn.
    """
    if specials in ("chatml", "llama3"):
        head, turn, gen = _CHATML if specials == "chatml" else _LLAMA3
        body = "".join(turn.format(role=role, content=content) for role, content in turns)
        return head + body + (gen if add_generation_prompt else "")
    if specials != "deepseek":
        raise ValueError(f"specials must be one of {CHAT_FAMILIES}, got {specials!r}")
    parts = ["<｜begin▁of▁sentence｜>"]
    for role, content in turns:
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts.append(f"<｜User｜>{content}")
        elif role == "assistant":
            parts.append(f"<｜Assistant｜>{content}<｜end▁of▁sentence｜>")
        elif role == "tool":
            parts.append(
                f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
            )
        else:
            raise ValueError(f"deepseek template has no role {role!r} (system, user, assistant, tool)")
    if add_generation_prompt:
        parts.append("<｜Assistant｜>")
    return "".join(parts)
