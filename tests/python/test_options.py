"""Every option in every API: docs/options.md holds one table per options struct, and each
binding is checked against it, so that an option added to one API and forgotten in another
fails here rather than drifting (C++ headers, the C params and what capi reads of them, the
CLI's --help, Python's signatures and the .pyi stubs)."""
import ast
import inspect
import os
import re
import subprocess

import expert_arena
import pytest

from conftest import ROOT, tool

NONE = "—"


def read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def tables():
    """{section title: [rows]} of docs/options.md; a row maps each header's word to the
    spellings in its cell (none for a dash)."""
    out, title, header = {}, None, None
    for line in read("docs", "options.md").splitlines():
        if line.startswith("## "):
            title, header = line[3:].strip(), None
            continue
        if not line.startswith("|") or title is None:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(cells[0]) <= set("-"):
            # A cell names one spelling or several (`model_files`, `model_file_count`).
            row = {}
            for name, cell in zip(header, cells):
                row[name] = re.findall(r"`([^`]+)`", cell) if cell != NONE else []
            out.setdefault(title, []).append(row)
    return out


def cpp_fields(header, struct):
    """Data members of `struct` in a C++ header (methods and comments left out)."""
    text = read("include", "expert_arena", header)
    body = re.search(r"\nstruct (?:EXPERT_ARENA_EXPORT )?%s \{\n(.*?)\n\};" % struct, text,
                     re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line.endswith(";") or "(" in line:
            continue
        m = re.match(r"[\w:<>, ]+?[\s&*]+(\w+)(\s*=.*)?;$", line)
        if m:
            fields.append(m.group(1))
    return fields


def c_fields(header, struct):
    text = read("include", "expert_arena", header)
    body = re.search(r"typedef struct %s \{\n(.*?)\n\} %s;" % (struct, struct), text,
                     re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = re.findall(r"(\w+);", body)
    return [n for n in names if n != "size"]


def signature_names(fn):
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def stub_names(qualified):
    tree = ast.parse(read("python", "expert_arena", "__init__.pyi"))
    scope = tree.body
    *classes, fn = qualified.split(".")
    for cls in classes:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == fn)
    a = node.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg != "self"]


def cli_flags(command):
    out = subprocess.run([tool("expert-arena"), command, "--help"], capture_output=True,
                         text=True, check=True).stdout
    flags = set(re.findall(r"^\s+(?:-\w,)?(--[a-z][a-z0-9-]*)", out, re.M))
    return flags - {"--help"}


def check_table(rows, column, offered, api):
    """Every spelling of `column` is offered by the API, and the API offers nothing the table
    does not name."""
    named = {name for r in rows for name in r[column]}
    missing = sorted(named - set(offered))
    unnamed = sorted(set(offered) - named)
    assert not missing, "%s lacks %s, which docs/options.md gives" % (api, missing)
    assert not unnamed, "%s has %s, which no row of docs/options.md names" % (api, unnamed)


ARENA = "Opening an arena"
PRODUCER = "A stream producer"
CONSUMER = "A stream consumer"


def test_every_cpp_option_has_a_row():
    t = tables()
    check_table(t[ARENA], "C++", cpp_fields("arena.h", "ModelSpec") +
                cpp_fields("arena.h", "ArenaOptions"), "ModelSpec + ArenaOptions")
    check_table(t[PRODUCER], "C++", cpp_fields("stream.h", "StreamOptions"), "StreamOptions")
    check_table(t[CONSUMER], "C++", cpp_fields("stream.h", "ConsumerOptions"), "ConsumerOptions")


def test_c_params_match_the_table_and_capi_reads_each():
    t = tables()
    check_table(t[ARENA], "C", c_fields("expert_arena.h", "ea_open_params"), "ea_open_params")
    stream_fields = c_fields("expert_arena_stream.h", "ea_stream_params")
    check_table(t[PRODUCER] + t[CONSUMER], "C", stream_fields, "ea_stream_params")
    # A field the header declares and the library never reads would be silently ignored.
    capi = read("src", "capi", "capi.cc")
    for name in c_fields("expert_arena.h", "ea_open_params"):
        assert re.search(r"\bp(arams)?(->|\.)%s\b" % name, capi), "capi.cc never reads " + name
    capi_stream = read("src", "capi", "capi_stream.cc")
    for name in stream_fields:
        assert re.search(r"\bp(->|\.)%s\b" % name, capi_stream), \
            "capi_stream.cc never reads " + name


def test_cli_load_flags_match_the_table():
    check_table(tables()[ARENA], "CLI", cli_flags("load"), "expert-arena load")


@pytest.mark.parametrize("section, qualified", [
    (ARENA, "open"),
    (PRODUCER, "StreamProducer.__init__"),
    (CONSUMER, "StreamConsumer.__init__"),
])
def test_python_keywords_and_stubs_match_the_table(section, qualified):
    rows = tables()[section]
    obj = expert_arena
    for part in qualified.split("."):
        obj = getattr(obj, part)
    check_table(rows, "Python", signature_names(obj), "expert_arena." + qualified)
    check_table(rows, "Python", stub_names(qualified), "__init__.pyi " + qualified)


def test_a_binding_that_lacks_an_option_fails_the_check():
    rows = [{"C++": ["gpu"], "Python": ["gpu"]}, {"C++": ["reader"], "Python": ["reader"]}]
    with pytest.raises(AssertionError, match=r"lacks \['reader'\]"):
        check_table(rows, "Python", ["gpu"], "an API")
    with pytest.raises(AssertionError, match=r"has \['huge'\]"):
        check_table(rows, "Python", ["gpu", "reader", "huge"], "an API")
