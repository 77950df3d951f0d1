"""Bad input to `query`, `index`, `eval` and the Python API's `search`, `evaluate`, `index`:
one line naming the problem, before any model loads, OUT untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import out_digest
from _search_sets import TEXTS, embedded_set
from _serve import ROOT, cli_env, serving

from pipeline.config import Device
from pipeline.index import IndexRequest, index_set
from pipeline.names import SET_NAME

UNREACHABLE = "http://127.0.0.1:1"  # nothing listens there: a request would fail to connect


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, tiny_model_dir) -> Path:
    out = embedded_set(tmp_path_factory.mktemp("query-input"), tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    return out


@pytest.fixture(scope="module")
def queries(indexed) -> Path:
    path = indexed.parent / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:3], "doc_id": [100, 101, 102]}), path)
    return path


def _cli(*args: object, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *map(str, args)], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=300)


def _refused(done: subprocess.CompletedProcess, command: str) -> str:
    """The one-line reason of a command that failed on its input (exit 1)."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"embedpipe {command}: error: "), lines
    return lines[0]


# ---- query --url ---------------------------------------------------------------------------

@pytest.mark.parametrize("option", [["--corpus", "c.parquet"], ["--device", "cpu"],
                                    ["--trust-remote-code"]])
def test_query_url_refuses_the_options_only_a_local_out_takes(option):
    """They were silently ignored: the server loads the set its own way."""
    line = _refused(_cli("query", "--url", UNREACHABLE, *option, "some", "words"), "query")
    assert f"{option[0]} is not taken with --url" in line  # refused before any request
    # serve has --device and --trust-remote-code, but no --corpus (it was told to give it)
    assert ("give it to `embedpipe serve`" in line) == (option[0] != "--corpus")


def test_query_url_refuses_an_out_before_the_words(indexed):
    """`query OUT --url URL words` sent OUT's path as the first query word."""
    line = _refused(_cli("query", indexed, "--url", UNREACHABLE, "the", "cat"), "query")
    assert f"{str(indexed)!r} is an output folder with sets: give OUT or --url, not both" in line


def test_query_url_sends_a_word_naming_a_folder_without_sets(indexed, tmp_path):
    """Only a folder holding sets is taken for OUT: any other word, even an existing folder's
    name, is a query word, sent to the server as given."""
    (tmp_path / "cats" / "sets").mkdir(parents=True)  # a folder, and a sets/ without a set
    with serving(indexed) as (url, _, _):
        done = _cli("query", "--url", url, "-k", "2", "--json", "cats", "on", "mats",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["query"] == "cats on mats" and len(payload["results"]) == 2


@pytest.mark.parametrize("args, reason", [
    (["--url", "", "hello"], "'' is not a server URL"),  # was: `hello` taken for OUT
    (["--url", UNREACHABLE, "--set", "", "hello"], "invalid set name ''"),  # was: dropped
])
def test_query_url_empty_values_are_refused_not_dropped(args, reason):
    assert reason in _refused(_cli("query", *args), "query")


# ---- query words after -- ------------------------------------------------------------------

def test_words_after_double_dash_are_the_query_even_after_options(indexed):
    """A query that starts with '-' goes after `--`, wherever the options are."""
    done = _cli("query", indexed, "-k", "1", "--json", "--", "-fno-strict-aliasing", "flag")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["query"] == "-fno-strict-aliasing flag"
    done = _cli("query", indexed, "--json", "gcc", "-k", "1", "--", "-O2", "-k", "3")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["query"] == "gcc -O2 -k 3" and len(payload["results"]) == 1
    unknown = _cli("query", indexed, "-k", "1", "-fno-strict-aliasing", "flag")
    assert unknown.returncode == 2 and "unrecognized arguments: -fno-strict-aliasing" in \
        unknown.stderr
    assert "words after -- are all query words" in " ".join(_cli("query", "--help").stdout
                                                            .split())


# ---- query, index, eval: names and paths ---------------------------------------------------

@pytest.mark.parametrize("command", ["index", "query"])
@pytest.mark.parametrize("name", ["../etc", ""])
def test_a_bad_set_name_is_one_line_naming_it_and_the_rule(indexed, command, name):
    """`query --set ""` searched the default set instead."""
    before = out_digest(indexed)
    words = ["the", "cat"] if command == "query" else []
    line = _refused(_cli(command, indexed, "--set", name, *words), command)
    assert f"invalid set name {name!r}" in line and SET_NAME.pattern in line
    assert out_digest(indexed) == before


@pytest.mark.parametrize("option", ["--plot", "--out"])
@pytest.mark.parametrize("path", ["", " "])
def test_eval_refuses_an_empty_report_path(indexed, queries, tmp_path, option, path):
    """`eval --plot ""` exited 0 writing nothing; `--out " "` wrote a file named ' '."""
    before = out_digest(indexed)
    done = _cli("eval", indexed, queries, option, path, cwd=tmp_path)
    assert f"{option} is an empty path" in _refused(done, "eval")
    assert list(tmp_path.iterdir()) == [] and out_digest(indexed) == before


def test_query_refuses_an_empty_corpus(indexed):
    """`query --corpus ""` took the recorded corpus instead."""
    line = _refused(_cli("query", indexed, "--corpus", "", "the", "cat"), "query")
    assert "corpus (--corpus) is empty" in line


# ---- the Python API ------------------------------------------------------------------------

API_CASES = {  # id: (call, keyword arguments, what the one line says)
    "search device": ("search", {"device": "tpu"}, "device: Input should be "),
    "search snippets": ("search", {"snippets": "no"}, "snippets: Input should be a valid boolean"),
    "search trust": ("search", {"trust_remote_code": 1}, "trust_remote_code: Input should be a "
                     "valid boolean"),
    "search set_name": ("search", {"set_name": ""}, "invalid set name ''"),
    "evaluate exact": ("evaluate", {"exact": "no"}, "exact: Input should be a valid boolean"),
    "evaluate exact 0": ("evaluate", {"exact": 0}, "exact: Input should be a valid boolean"),
    "evaluate device": ("evaluate", {"device": "gpu"}, "device: Input should be "),
    "evaluate trust": ("evaluate", {"trust_remote_code": "yes"}, "trust_remote_code: Input "
                       "should be a valid boolean"),
    "evaluate ranks_out": ("evaluate", {"ranks_out": ""}, "ranks_out is an empty path"),
    "index rebuild": ("index", {"rebuild": "no"}, "rebuild: Input should be a valid boolean"),
    "index progress": ("index", {"progress": "no"}, "progress: Input should be a valid boolean"),
    "index memory_budget": ("index", {"memory_budget": True}, "memory budget True is not a "
                            "size"),
    "embed index": ("embed", {"index": "no"}, "index: Input should be a valid boolean"),
}
_CALLER = """
import json, sys, embedpipe
call, out, queries, fresh, kwargs = json.loads(sys.argv[1])
corpus = f"{out}/../corpus.parquet"  # the set's own corpus, embedded into a new OUT
first = {"search": [out, "the cat"], "evaluate": [out, queries], "index": [out],
         "embed": [corpus, fresh]}[call]
try:
    getattr(embedpipe, call)(*first, **kwargs)
    said = None
except embedpipe.EmbedpipeError as exc:
    said = str(exc)
print(json.dumps({"said": said, "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_arguments_of_the_wrong_type_or_value_are_one_line_before_any_model(
        indexed, queries, tmp_path, case):
    """`evaluate(exact="no")` ran an exact search, `search(device="tpu")` said "invalid the
    encoder of set ...", `index(rebuild="no")` rebuilt, `embed(index="no")` indexed: each is
    one line naming the argument, before torch is even imported, no OUT touched."""
    call, kwargs, reason = API_CASES[case]
    before, fresh = out_digest(indexed), tmp_path / "fresh-out"
    done = subprocess.run([sys.executable, "-c", _CALLER,
                           json.dumps([call, str(indexed), str(queries), str(fresh), kwargs])],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["said"] is not None and reason in result["said"], result
    assert len(result["said"].splitlines()) == 1 and not result["torch"], result
    if "device" in kwargs:  # the allowed values, from the type itself
        assert all(repr(value) in result["said"] for value in get_args(Device))
    assert out_digest(indexed) == before and not fresh.exists()
