"""Cached stateless encodes (``encode(..., cache=True)``) through a real sidecar: Unix socket,
shared memory, real tokenizers.

Every cached encode's IDs are compared with the reference encoding; the layers, reuse counts and
metrics are compared with an in-process :class:`toktier.PrefixCache` fed the same calls (the
sidecar must add nothing and lose nothing); the flags and TOML switch each layer off; a large
cached encode runs off the event loop while other clients are answered."""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
import threading
import urllib.request
from dataclasses import fields

import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import toktier
from sidecar_raw import Raw
from toktier_client import AsyncClient, Client, InvalidText, TooLarge, UnknownTokenizer
from toktier_client import protocol as P
from toktier_sidecar import ServerConfig
from toktier_sidecar.cli import build_parser, load_config
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)
from sidecar_harness import backing, shm_names

CACHE_FIELDS = {f.name for f in fields(ServerConfig) if f.name.startswith("tokenizer_cache_")}

SYSTEM = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
          + "".join(f"Rule {i}: answer carefully, cite sources, and never invent numbers like {i * 37}. "
                    for i in range(120))
          + "<|eot_id|>")  # ~10K characters: more than one 4 KiB block, so L1 can match it


def user(msg: str) -> str:
    return f"<|start_header_id|>user<|end_header_id|>\n\n{msg}<|eot_id|>"


def assistant(msg: str) -> str:
    return f"<|start_header_id|>assistant<|end_header_id|>\n\n{msg}<|eot_id|>"


def branching_workload() -> list[tuple[str, str]]:
    """(text, expected layer): a shared system prompt, divergent suffixes, retries, a turn
    replaced, a prefix cut inside a word, numbers, non-ASCII, an unrelated short text."""
    a = SYSTEM + user("What is 2+2?")
    b = SYSTEM + user("What is 3+3?")
    b2 = b + assistant("6") + user("And 4+4?")
    return [
        (a, "miss"),
        (b, "l1"),  # another conversation, the same system prompt
        (b, "l0"),  # a retry: the same text
        (b2, "l1"),  # the conversation grew
        (b + assistant("Six."), "l1"),  # the last turn replaced (a regenerated answer)
        (SYSTEM[:-37] + "zzz: different 1234567890", "l1"),  # diverges inside a word
        (a, "l0"),
        ("a short unrelated text", "miss"),
        (SYSTEM + user("x = " + "9" * 300 + " + 1"), "l1"),  # a digit run after the shared part
        (SYSTEM + user("naïve café, 東京タワー 🙂👩‍💻"), "l1"),
        (b2, "l0"),
    ]


def check(r, tok, text: str) -> None:
    """Exact, zero-copy, and the reuse fields consistent with the layer."""
    assert np.array_equal(r.ids, tok.encode(text)), (r.layer, len(text))
    assert isinstance(backing(r.ids), mmap.mmap) and not r.ids.flags.writeable and r.ids.dtype == np.uint32
    assert r.path == "full" and r.seq == 0 and r.valid
    if r.layer in ("miss", "off"):
        assert (r.first_changed, r.reused_chars) == (0, 0)
    elif r.layer == "l0":
        assert (r.first_changed, r.reused_chars) == (len(r.ids), len(text))
    else:
        assert r.layer == "l1" and 0 < r.first_changed <= len(r.ids) and 0 < r.reused_chars <= len(text)


def released(prefix: str) -> bool:
    """Whether every handoff segment's name is gone (``Release`` is one-way: the sidecar unlinks
    the name after the reply was mapped, so poll briefly)."""
    for _ in range(500):
        if not shm_names(prefix):
            return True
        threading.Event().wait(0.01)
    return False


def scrape(port: int) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def metric(body: dict, name: str, **labels: str) -> float:
    return body.get((name, tuple(sorted(labels.items()))), 0.0)


# ----------------------------------------------------------------------------- exactness


def test_branching_workload_is_exact_with_the_layers_of_an_in_process_cache(sidecar, llama3):
    ref = toktier.PrefixCache(llama3)  # the same defaults as the sidecar's
    with Client(sidecar.path) as c:
        for i, (text, layer) in enumerate(branching_workload()):
            r = c.encode(text, tokenizer="llama3", cache=True)
            check(r, llama3, text)
            want = ref.encode(text)
            assert r.layer == layer == want.layer, i
            assert (r.first_changed, r.reused_chars) == (want.first_changed, want.reused_chars), i
            assert r.tokenizer == llama3.hash
    assert released(sidecar.prefix)  # every handoff was released (its name unlinked)


def test_ids_are_a_read_only_view_of_a_released_segment(sidecar, llama3):
    text = SYSTEM + user("hello")
    with Client(sidecar.path) as c:
        first = c.encode(text, cache=True)
        again = c.encode(text, cache=True)
    assert (first.layer, again.layer) == ("miss", "l0")
    for r in (first, again):
        assert isinstance(backing(r.ids), mmap.mmap)
        with pytest.raises(ValueError):
            r.ids[0] = 1  # read-only
        assert r.segment.lstrip("/").startswith(sidecar.prefix + "-")
    assert first.segment != again.segment  # one-shot segments, never shared between results
    assert released(sidecar.prefix)  # names unlinked, views still readable
    assert np.array_equal(first.ids, again.ids) and np.array_equal(again.ids, llama3.encode(text))


def test_cache_false_is_a_plain_encode(start_sidecar, llama3):
    sc = start_sidecar(metrics_port=0)
    text = SYSTEM + user("plain")
    with Client(sc.path) as c:
        for r in (c.encode(text), c.encode(text, cache=False), c.encode(text, tokenizer="llama3")):
            check(r, llama3, text)
            assert r.layer == "off"
    assert sc.sidecar.service.cache_stats() == []  # no cache was even created
    body = scrape(sc.sidecar.metrics_port)
    assert not any(name.startswith("toktier_tokenizer_cache_") for name, _ in body)
    assert metric(body, "toktier_requests_total", op="encode", outcome="ok") == 3


def test_specials_variants_have_their_own_cache(start_sidecar, registry):
    sc = start_sidecar()
    none = registry.load("llama3", specials="none")
    text = SYSTEM + user("literal")  # special-token literals: other IDs as plain text
    with Client(sc.path) as c:
        r_all = c.encode(text, cache=True)
        r_none = c.encode(text, cache=True, specials="none")
        assert (r_all.layer, r_none.layer) == ("miss", "miss")  # never the other variant's entry
        check(r_none, none, text)
        assert not np.array_equal(r_all.ids, r_none.ids)
        assert c.encode(text, cache=True, specials="none").layer == "l0"
    assert sorted(st.lookups["l0", "hit"] for _, st in sc.sidecar.service.cache_stats()) == [0, 1]


async def test_async_client_concurrent_cached_encodes(sidecar, llama3):
    texts = [SYSTEM + user(f"question {i}: what is {i} * {i}?") for i in range(12)]
    async with AsyncClient(sidecar.path) as c:
        first = await c.encode(texts[0], tokenizer="llama3", cache=True)
        assert first.layer == "miss"
        results = await asyncio.gather(*(c.encode(t, tokenizer="llama3", cache=True) for t in texts[1:]))
        for t, r in zip(texts[1:], results):
            check(r, llama3, t)
            assert r.layer == "l1"  # every branch reuses the shared system prompt
        repeats = await asyncio.gather(*(c.encode(t, cache=True) for t in texts))
        for t, r in zip(texts, repeats):
            check(r, llama3, t)
            assert r.layer == "l0"
        plain = await c.encode(texts[0])
        assert plain.layer == "off" and np.array_equal(plain.ids, first.ids)


def test_verifier_checks_cached_answers(start_sidecar, llama3):
    sc = start_sidecar(verify_rate=1.0, verify_chars_per_second=0)
    with Client(sc.path) as c:
        for text, _ in branching_workload():
            c.encode(text, cache=True)
    shadow = sc.sidecar.verifier
    assert shadow.drain(30)
    st = shadow.stats
    assert st.offered == len(branching_workload()) and st.checked > 0
    assert st.mismatches == 0 and st.errors == 0


def test_caches_are_per_namespace_and_bypassed_when_the_fast_path_is_off(start_sidecar, llama3):
    sc = start_sidecar()
    svc = sc.sidecar.service
    text = SYSTEM + user("private")
    with Client(sc.path) as c:
        assert c.encode(text, cache=True).layer == "miss"
        assert c.encode(text, cache=True).layer == "l0"
        # another peer uid's cache never saw it: layer and reused_chars cannot leak what this uid sent
        assert svc.prefix_cache(os.getuid() + 1, llama3).encode(text).layer == "miss"
        svc.fast_path_disabled = lambda tokenizer_hash: True  # what a confirmed verifier mismatch does
        r = c.encode(text, cache=True)
        check(r, llama3, text)
        assert r.layer == "off"


# ------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("l0, l1, layers", [
    (True, True, ["miss", "l1", "l0", "miss", "l0"]),
    (False, True, ["miss", "l1", "l1", "miss", "miss"]),  # a repeat is found by prefix; a short one not at all
    (True, False, ["miss", "miss", "l0", "miss", "l0"]),  # no prefix reuse
    (False, False, ["off", "off", "off", "off", "off"]),  # cached encodes answered as plain ones
])
def test_each_layer_can_be_switched_off(start_sidecar, llama3, l0, l1, layers):
    sc = start_sidecar(tokenizer_cache_enable_l0=l0, tokenizer_cache_enable_l1=l1)
    a, b = SYSTEM + user("one"), SYSTEM + user("two")
    with Client(sc.path) as c:
        got = []
        for text in (a, b, b, "short", "short"):
            r = c.encode(text, cache=True)
            check(r, llama3, text)
            got.append(r.layer)
    assert got == layers


def test_flags_and_toml_set_the_cache_fields(tmp_path):
    def parse(*argv: str) -> dict:
        config = load_config(build_parser().parse_args(list(argv)))
        return {name: getattr(config, name) for name in CACHE_FIELDS}

    assert parse() == {"tokenizer_cache_enable_l0": True, "tokenizer_cache_l0_max_entries": 4096,
                       "tokenizer_cache_enable_l1": True, "tokenizer_cache_l1_max_memory": 256 << 20}
    flags = parse("--no-tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1=false",
                  "--tokenizer-cache-l0-max-entries", "7", "--tokenizer-cache-l1-max-memory", "64M")
    assert flags == {"tokenizer_cache_enable_l0": False, "tokenizer_cache_l0_max_entries": 7,
                     "tokenizer_cache_enable_l1": False, "tokenizer_cache_l1_max_memory": 64 << 20}
    assert parse("--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1", "on")["tokenizer_cache_enable_l1"]
    toml = tmp_path / "t.toml"
    toml.write_text('tokenizer_cache_enable_l1 = false\ntokenizer_cache_l0_max_entries = 12\n'
                    'tokenizer_cache_l1_max_memory = "1G"\n')
    from_file = parse("--config", str(toml))
    assert from_file == {"tokenizer_cache_enable_l0": True, "tokenizer_cache_l0_max_entries": 12,
                         "tokenizer_cache_enable_l1": False, "tokenizer_cache_l1_max_memory": 1 << 30}
    assert parse("--config", str(toml), "--tokenizer-cache-enable-l1")["tokenizer_cache_enable_l1"]  # flags win
    toml.write_text("tokenizer_cache_l1_max_memory = 1048576\n")
    assert parse("--config", str(toml))["tokenizer_cache_l1_max_memory"] == 1 << 20


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-cache-l0-max-entries", "0"], "tokenizer_cache_l0_max_entries must be an integer >= 1"),
    (["--tokenizer-cache-l1-max-memory", "0"], "tokenizer_cache_l1_max_memory must be an integer >= 1"),
    (["--tokenizer-cache-l1-max-memory", "lots"], None),  # argparse: invalid _size value
    (["--tokenizer-cache-enable-l0", "maybe"], None),  # argparse: expected true or false
])
def test_bad_cache_flags_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as ei:
        load_config(build_parser().parse_args(argv))
    if message is not None:
        assert message in str(ei.value.code)
    else:
        assert ei.value.code == 2 and "tokenizer-cache" in capsys.readouterr().err


def test_bad_cache_config_values_are_typed():
    with pytest.raises(toktier.InvalidCacheConfig, match="tokenizer_cache_enable_l0 must be true or false"):
        ServerConfig(tokenizer_cache_enable_l0="no")
    with pytest.raises(ValueError, match="tokenizer_cache_l1_max_memory"):
        ServerConfig(tokenizer_cache_l1_max_memory=-1)
    # sizes do not matter when no cache is ever built
    ServerConfig(tokenizer_cache_enable_l0=False, tokenizer_cache_enable_l1=False, tokenizer_cache_l0_max_entries=0)


def test_bad_toml_size_exits(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text('tokenizer_cache_l1_max_memory = "lots"\n')
    with pytest.raises(SystemExit, match="size like 256M"):
        load_config(build_parser().parse_args(["--config", str(toml)]))


# ------------------------------------------------------------------------------- metrics


def test_metrics_reflect_the_calls(start_sidecar, llama3):
    sc = start_sidecar(metrics_port=0)
    ref = toktier.PrefixCache(llama3)
    with Client(sc.path) as c:
        for text, _ in branching_workload():
            c.encode(text, cache=True)
            ref.encode(text)
        c.encode("not cached")  # a plain encode: no lookup
    body = scrape(sc.sidecar.metrics_port)
    want = ref.stats()
    for (layer, result), n in want.lookups.items():
        assert metric(body, "toktier_tokenizer_cache_lookups_total", tokenizer="llama3", layer=layer,
                      result=result) == n, (layer, result)
    assert sum(want.lookups.values()) > 0 and want.lookups["l0", "hit"] == 3 and want.lookups["l1", "hit"] == 6
    for layer in ("l0", "l1"):
        assert metric(body, "toktier_tokenizer_cache_reused_bytes_total", tokenizer="llama3",
                      layer=layer) == want.reused_bytes[layer] > 0
        assert metric(body, "toktier_tokenizer_cache_evictions_total", tokenizer="llama3", layer=layer) == 0
    ((name, held),) = [(n, st.bytes_held) for n, st in sc.sidecar.service.cache_stats()]
    assert name == "llama3" and held["l1"] > len(SYSTEM)  # at least one copy of the shared prompt
    for layer in ("l0", "l1"):  # read from the cache at scrape time
        assert metric(body, "toktier_tokenizer_cache_bytes", tokenizer="llama3", layer=layer) == held[layer]
    assert metric(body, "toktier_requests_total", op="encode", outcome="ok") == len(branching_workload()) + 1


def test_metrics_count_evictions_and_bytes_stay_bounded(start_sidecar, llama3):
    bound = 64 * 1024
    sc = start_sidecar(metrics_port=0, tokenizer_cache_l0_max_entries=2, tokenizer_cache_l1_max_memory=bound)
    texts = [f"document {i}: " + f"line {i} of text, with numbers {i * 101}.\n" * 200 for i in range(8)]
    with Client(sc.path) as c:
        for text in texts:
            check(c.encode(text, cache=True), llama3, text)
        for text in texts[-2:]:  # the two most recent are still cached
            assert c.encode(text, cache=True).layer == "l0"
    body = scrape(sc.sidecar.metrics_port)
    assert metric(body, "toktier_tokenizer_cache_evictions_total", tokenizer="llama3", layer="l1") > 0
    assert metric(body, "toktier_tokenizer_cache_evictions_total", tokenizer="llama3", layer="l0") > 0
    assert 0 < metric(body, "toktier_tokenizer_cache_bytes", tokenizer="llama3", layer="l1") <= bound
    assert metric(body, "toktier_tokenizer_cache_bytes", tokenizer="llama3", layer="l0") > 0


# ----------------------------------------------------------------------------- event loop


def test_a_large_cached_encode_does_not_block_other_clients(sidecar, llama3):
    big = SYSTEM + user("summarize: " + "The quick brown fox jumps over the lazy dog. " * 1200)  # ~64K chars
    assert len(big) > sidecar.config.inline_chars
    with Client(sidecar.path) as c:
        c.encode(SYSTEM + user("warm up"), cache=True)  # creates this uid's cache
    cache = sidecar.sidecar.service.prefix_cache(os.getuid(), llama3)
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []
    real = cache.encode

    def held(text: str):
        if len(text) > sidecar.config.inline_chars:
            threads.append(threading.current_thread().name)
            entered.set()
            assert release.wait(30)
        return real(text)

    cache.encode = held
    result: list = []

    def big_encode() -> None:
        with Client(sidecar.path) as c:
            result.append(c.encode(big, cache=True))

    worker = threading.Thread(target=big_encode)
    worker.start()
    try:
        assert entered.wait(30), "the large cached encode never started"
        with Client(sidecar.path, timeout=30) as other:  # answered while the big one is held
            assert other.ping().id > 0
            small = other.encode("a small cached text", cache=True)
            check(small, llama3, "a small cached text")
            assert small.layer == "miss"
            assert not result  # the big one is still running
    finally:
        release.set()
        worker.join(30)
    assert threads and threads[0].startswith("toktier-bulk")  # a worker thread, not the loop
    (r,) = result
    check(r, llama3, big)
    assert r.layer == "l1"  # the shared system prompt came from the cache


# -------------------------------------------------------------------------------- errors


def test_bad_arguments_give_typed_errors(start_sidecar):
    sc = start_sidecar(max_session_chars=50_000, lazy_load=False)
    with Client(sc.path) as c:
        with pytest.raises(TypeError, match="cache must be True or False"):
            c.encode("x", cache="yes")  # local misuse: nothing sent
        with pytest.raises(UnknownTokenizer) as ei:
            c.encode("x", tokenizer="no-such-tokenizer", cache=True)
        assert isinstance(ei.value, KeyError) and "served" in str(ei.value)
        with pytest.raises(TooLarge):
            c.encode("y" * 50_001, cache=True)
        with pytest.raises(InvalidText):
            c.encode("lone \ud800 surrogate", cache=True)
        assert c.encode("still fine", cache=True).layer == "miss"  # the connection survived
    r = Raw(sc.path)  # a peer that sends a wrongly typed field
    raw = msgspec.msgpack.encode({"t": "encode", "id": 5, "text": "x", "cache": "yes"})
    r.send(struct.pack(">I", len(raw)) + raw)
    (err,) = r.replies(1)
    assert (err.id, err.code, err.fatal) == (5, P.ErrorCode.BAD_REQUEST, False) and "cache" in err.message
    r.close()


def test_wire_fields_are_compatible(sidecar, llama3):
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(P.Encode(id=1, text="x")))
    assert "cache" not in old  # an encode without the cache is the bytes an old client sends
    r = Raw(sidecar.path)
    r.send(P.encode_frame(P.Encode(id=1, text="hello")))
    (ids,) = r.replies(1)
    assert ids.layer == "off" and ids.reused_chars == 0
    r.send(P.encode_frame(P.Release(segment=ids.segment)))
    r.close()
    old_reply = {"t": "ids", "id": 2, "segment": "s", "offset": 64, "count": 0, "seq": 0, "first_changed": 0,
                 "path": "full", "tokenizer": "h", "handoff": True}  # what a server without the cache sends
    decoded = P.REPLY_DECODER.decode(msgspec.msgpack.encode(old_reply))
    assert (decoded.layer, decoded.reused_chars) == ("off", 0)
