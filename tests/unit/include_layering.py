#!/usr/bin/env python3
"""Fails when a file under src/<part>/ includes a header of a part above it (DESIGN.md, "Parts").

The layers, bottom up; a part may include its own headers, those of the parts in lower layers
and the public API (include/expert_arena/), never a part of its own layer or above:

  common                    status, logging, hashes, escaping: below everything
  platform                  every Linux call
  format                    the arena file
  source                    model readers
  load                      moving bytes
  pages, gpu                the page backing; host-memory registration (an arena registers
                            its mapping through gpu, so gpu sits below arena)
  arena, stream             the load-once/attach protocol; tensor streams
  remote, metrics           across hosts (implements arena/peer_transport.h and
                            stream/stream_remote.h); directory metrics (reads arena files)
  capi                      the C interface

Usage: include_layering.py SRC_DIR
"""
import pathlib
import re
import sys

LAYERS = [
    ["common"],
    ["platform"],
    ["format"],
    ["source"],
    ["load"],
    ["pages", "gpu"],
    ["arena", "stream"],
    ["remote", "metrics"],
    ["capi"],
]
RANK = {part: i for i, parts in enumerate(LAYERS) for part in parts}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]+"')


def main() -> int:
    src = pathlib.Path(sys.argv[1])
    problems = []
    seen = set()
    for path in sorted(src.rglob("*")):
        if path.suffix not in (".h", ".cc", ".cpp") or not path.is_file():
            continue
        part = path.relative_to(src).parts[0]
        if part not in RANK:
            problems.append(f"{path}: src/{part}/ is in no layer of this check")
            continue
        seen.add(part)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            if target == part or target == "expert_arena":
                continue
            if target not in RANK:
                continue  # a third-party header with a directory (spdlog/..., nlohmann/...)
            if RANK[target] >= RANK[part]:
                problems.append(f"{path}:{number}: src/{part}/ includes {line.strip()[9:]}, "
                                f"a header of {'the same layer' if RANK[target] == RANK[part] else 'a layer above'}")
    missing = [p for p in RANK if p not in seen]
    if missing:
        problems.append(f"{src}: no files found in {', '.join(missing)} (wrong directory?)")
    for p in problems:
        print(p)
    if not problems:
        print(f"include layering: {len(seen)} parts, no include points up")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
