"""README's figures come from DETAILS.md's headline table or from the page the same paragraph
cites: a figure quoted in README that neither holds (a rounding, a stale run, a number from
nowhere) fails here, so README and DETAILS.md cannot drift apart again."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A measured figure: a number or a range and its unit ("0.24-0.34 s", "1.05-1.18x", "2.77 GiB").
FIGURE = re.compile(r"(?<![\w.:/-])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?) ?(x|s|ms|us|GiB/s|GiB|MiB|KiB|%)(?![\w/])")
# Sizes that name a setting, not a measurement: page sizes, the demo model's size, fuzzing time.
NOT_MEASURED = {"2 MiB", "1 GiB", "4 KiB", "1.1 GiB", "20 s"}
LINK = re.compile(r"\(?((?:docs/)[\w.-]+\.md)")


def paragraphs(text):
    """README's prose paragraphs, code blocks left out (their output lines are examples)."""
    prose, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            prose.append("")
            continue
        prose.append("" if in_code else line)
    return [p for p in "\n".join(prose).split("\n\n") if p.strip()]


def figures(paragraph):
    return [f"{m.group(1)} {m.group(2)}" if m.group(2) != "x" and m.group(2) != "%" else
            m.group(1) + m.group(2) for m in FIGURE.finditer(paragraph.replace("\n", " "))]


def holds(source, figure):
    flat = re.sub(r"\s+", " ", source)
    return any(re.search(r"(?<![\d.])" + re.escape(f) + r"(?![\d])", flat)
               for f in (figure, figure.replace(" ", "")))


def unsourced(readme, details, read_doc):
    missing = []
    for paragraph in paragraphs(readme):
        cited = [read_doc(path) for path in LINK.findall(paragraph)]
        for figure in figures(paragraph):
            if figure in NOT_MEASURED:
                continue
            if not any(holds(source, figure) for source in [details] + cited):
                missing.append((figure, paragraph.strip().splitlines()[0][:80]))
    return missing


def read_doc(path):
    target = ROOT / path
    return target.read_text() if target.exists() else ""


def test_every_figure_in_readme_comes_from_details_or_the_page_it_cites():
    readme = (ROOT / "README.md").read_text()
    details = (ROOT / "DETAILS.md").read_text()
    assert figures(readme), "no figure found in README.md: the pattern is wrong"
    missing = unsourced(readme, details, read_doc)
    assert not missing, "README.md quotes figures that DETAILS.md and the cited page lack:\n" + \
        "\n".join(f"  {f!r} in the paragraph starting {p!r}" for f, p in missing)


def test_a_figure_from_nowhere_fails_the_check():
    details = "| restart | 0.24-0.34 s | 1.46 s |"
    assert unsourced("A restart took 0.24-0.34 s against 1.46 s.", details, read_doc) == []
    assert unsourced("A restart took 0.24-0.41 s against 1.46 s.", details, read_doc) == [
        ("0.24-0.41 s", "A restart took 0.24-0.41 s against 1.46 s.")]
    # The cited page counts as a source for its own paragraph only.
    doc = {"docs/x.md": "took 3.5 s"}
    assert unsourced("Took 3.5 s (docs/x.md).", "", doc.get) == []
    assert unsourced("Took 3.5 s.\n\nSee docs/x.md.", "", doc.get) == [("3.5 s", "Took 3.5 s.")]
    # A figure is matched whole: 17 s is not in 117 s or 1.17 s.
    assert unsourced("Took 17 s.", "| 117 s | 1.17 s |", read_doc) == [("17 s", "Took 17 s.")]
