"""python -m expert_arena: look at arenas and stream segments from the package.

    python -m expert_arena info PATH [--json]   attach (never load) and print the report and
                                                the tensor table
    python -m expert_arena sweep [DIR]          remove stream segments of dead owners
    python -m expert_arena segment PATH         a stream segment's header and block table
    python -m expert_arena version

Exit codes: 0 success, 1 a clear refusal (the library's message on stderr), 2 bad usage.
"""

import argparse
import json
import sys

import expert_arena


def _info(args):
    with expert_arena.attach(args.path) as arena:
        report = arena.report
        tensors = []
        for t in arena.tensors():
            row = dict(t)
            row["shape"] = list(row["shape"])
            row["checksum"] = "%016x" % row["checksum"]
            tensors.append(row)
        if args.json:
            json.dump({"version": expert_arena.__version__, "report": report,
                       "tensors": tensors}, sys.stdout)
            print()
            return 0
        print(report["start_line"])
        print("%s: %d tensors, %d tensor bytes, %d data bytes, backing %s"
              % (args.path, report["tensors"], report["tensor_bytes"], report["data_bytes"],
                 report["backing"]))
        for t in tensors:
            print("  %-48s %-8s %-22s %12d bytes at %d, xxh3 %s"
                  % (t["name"], t["dtype"], t["shape"], t["bytes"], t["file_offset"],
                     t["checksum"]))
    return 0


def _sweep(args):
    report = expert_arena.sweep(args.directory)
    for path in report["removed"]:
        print("removed %s" % path)
    for note in report["notes"]:
        print("note: %s" % note)
    print("%d removed, %d live" % (len(report["removed"]), len(report["live"])))
    return 0


def _segment(args):
    json.dump(expert_arena.inspect_segment(args.path), sys.stdout, indent=1)
    print()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m expert_arena",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="attach to an arena and print its report and tensors")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_info)
    p = sub.add_parser("sweep", help="remove stream segments whose owner is gone")
    p.add_argument("directory", nargs="?", default="/dev/shm")
    p.set_defaults(run=_sweep)
    p = sub.add_parser("segment", help="print a stream segment's header and block table")
    p.add_argument("path")
    p.set_defaults(run=_segment)
    p = sub.add_parser("version", help="print the package version")
    p.set_defaults(run=lambda a: print(expert_arena.__version__) or 0)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (OSError, ValueError, KeyError) as e:
        print("python -m expert_arena %s: %s" % (args.command, e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
