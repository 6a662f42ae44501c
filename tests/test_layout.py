"""The course's layout agrees with itself: the lab of chapter NN is labNN_*, and every map says so.

A lab carries its chapter's number (a chapter may have no lab). The HTML index, the README's map, the chapter's
own pointer, the grader's lab id and the solution all follow from that one rule; these tests fail when one of
them drifts.
"""

import json
import pathlib
import re

from flashlab import site
from flashlab.grading import available_labs

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LABS = sorted((ROOT / "labs").glob("lab[0-9][0-9]_*.ipynb"))


def _number(path: pathlib.Path) -> str:
    return re.match(r"(?:lab)?(\d\d)_", path.name).group(1)


def _source(path: pathlib.Path) -> str:
    return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text(encoding="utf-8"))["cells"])


def test_every_lab_belongs_to_a_chapter_of_its_number():
    chapter_numbers = {_number(c) for c in CHAPTERS}
    assert LABS, "no labs found"
    for lab in LABS:
        assert _number(lab) in chapter_numbers, f"{lab.name} has no chapter {_number(lab)}_*"


def test_labs_solutions_and_graders_are_the_same_set():
    solutions = sorted(p.name for p in (ROOT / "solutions").glob("lab*.ipynb"))
    assert solutions == [lab.name for lab in LABS]
    assert available_labs() == [lab.name.split("_", 1)[0] for lab in LABS]


def test_each_lab_notebook_checks_with_its_own_grader():
    for lab in LABS:
        lab_id = lab.name.split("_", 1)[0]
        ids = set(re.findall(r'lab\("(lab\d\d)"\)', _source(lab)))
        assert ids == {lab_id}, f"{lab.name} grades with {sorted(ids)}, expected {lab_id}"
        title = _source(lab).lstrip().splitlines()[0]
        assert f"Lab {lab_id[3:]}" in title, f"{lab.name} is titled {title!r}"


def test_html_index_links_each_chapter_to_its_own_lab_and_no_other(tmp_path):
    site.write_index(tmp_path, CHAPTERS, LABS)
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    rows = re.findall(r"<tr><td><a href=\"(\d\d)_[^\"]*\.html\">.*?</tr>", page)
    assert len(rows) == len(CHAPTERS)
    for row in re.findall(r"<tr><td>.*?</tr>", page):
        chapter = re.search(r'href="(\d\d)_', row).group(1)
        linked = re.findall(r'href="labs/lab(\d\d)_', row)
        expected = [chapter] if any(_number(lab) == chapter for lab in LABS) else []
        assert linked == expected, f"chapter {chapter}'s row links labs {linked}"


def test_readme_map_links_each_chapter_to_its_own_lab():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if re.match(r"\|\s*(\d+|—)\s*\|\s*\[`\d\d_", line)]
    assert len(rows) == len(CHAPTERS)
    for row in rows:
        chapter = re.search(r"notebooks/(\d\d)_", row).group(1)
        linked = re.findall(r"labs/lab(\d\d)_", row)
        expected = [chapter] if any(_number(lab) == chapter for lab in LABS) else []
        assert linked == expected, f"README row of chapter {chapter} links labs {linked}"


def test_each_chapter_points_to_its_own_lab():
    for chapter in CHAPTERS:
        own = [lab for lab in LABS if _number(lab) == _number(chapter)]
        pointers = set(re.findall(r"labs/(lab\d\d)_", _source(chapter)))
        if chapter.name.startswith(("09_", "12_")):
            continue  # the mistakes chapter and the closing chapter speak of every lab
        expected = {own[0].name.split("_", 1)[0]} if own else set()
        assert pointers == expected, f"{chapter.name} points to {sorted(pointers)}, expected {sorted(expected)}"
