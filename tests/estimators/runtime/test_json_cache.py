"""estimators/runtime/json_cache.py: the one timing-cache file format of both benchmarks."""

import json
import os

import pytest

from estimators.runtime.json_cache import BenchmarkCacheError, JsonTimingCache


class _OtherError(BenchmarkCacheError):
    pass


def cache(path, **kw):
    return JsonTimingCache(path=path, format="test/cache", version=2, description="test cache", **kw)


def test_missing_file_is_empty_and_save_then_load_round_trips(tmp_path):
    c = cache(tmp_path / "sub" / "c.json", identity={"device": "cpu:x"})
    assert c.load() == {}
    c.save({"b": 2.5, "a": 1})
    data = json.loads(c.path.read_text())
    assert (data["format"], data["version"], data["device"]) == ("test/cache", 2, "cpu:x")
    assert c.load() == {"a": 1.0, "b": 2.5}


def test_save_merges_with_the_file_and_new_entries_win(tmp_path):
    c = cache(tmp_path / "c.json")
    c.save({"a": 1.0, "b": 2.0})
    c.save({"b": 3.0, "c": 4.0})
    assert c.load() == {"a": 1.0, "b": 3.0, "c": 4.0}


def test_save_replaces_a_file_it_cannot_read_and_leaves_no_temporary(tmp_path):
    c = cache(tmp_path / "c.json")
    c.path.write_text("{not json")
    c.save({"a": 1.0})
    assert c.load() == {"a": 1.0}
    assert os.listdir(tmp_path) == ["c.json"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "test cache .* is unreadable"),
        (json.dumps({"format": "other", "version": 2, "entries": {}}), "is not a test cache"),
        (json.dumps({"format": "test/cache", "version": 1, "entries": {}}), "has version 1, this code reads 2"),
        (json.dumps({"format": "test/cache", "version": 2, "device": "gpu", "entries": {}}),
         "measured on device 'gpu', this run measures on 'cpu'"),
        (json.dumps({"format": "test/cache", "version": 2, "device": "cpu", "entries": {"a": -1}}),
         "malformed entries"),
        (json.dumps({"format": "test/cache", "version": 2, "device": "cpu", "entries": {"a": True}}),
         "malformed entries"),
        (json.dumps({"format": "test/cache", "version": 2, "device": "cpu", "entries": []}),
         "malformed entries"),
    ],
)
def test_load_refuses_what_it_cannot_use_with_the_given_error(tmp_path, content, message):
    c = cache(tmp_path / "c.json", identity={"device": "cpu"}, error=_OtherError)
    c.path.write_text(content)
    with pytest.raises(_OtherError, match=message):
        c.load()
