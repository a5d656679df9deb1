"""Converts Mosquitto's DocBook manual pages (man/*.xml) to the Markdown in docs/.

    python mosquitto_man.py GIT_DIR COMMIT

reads man/<page>.xml at COMMIT from a clone of https://github.com/eclipse/mosquitto
and writes docs/man_<page>.md. Sections become headings, an option's term its
own line in backticks, lists and tables Markdown ones, programlistings fenced
blocks, inline markup its text; the words are the authors' own. Kept so that the
conversion can be redone, or checked, on another commit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

PAGES = (
    "mosquitto.conf.5",
    "mosquitto.8",
    "mosquitto_pub.1",
    "mosquitto_sub.1",
    "mosquitto_passwd.1",
    "mosquitto_ctrl.1",
    "mosquitto-tls.7",
    "mqtt.7",
)
BLOCKS = {
    "para",
    "variablelist",
    "itemizedlist",
    "orderedlist",
    "simplelist",
    "programlisting",
    "screen",
    "literallayout",
    "example",
    "important",
    "note",
    "informaltable",
}
_SPACE = re.compile(r"\s+")


def tag(el: ET.Element) -> str:
    return el.tag.rpartition("}")[2]


def inline(el: ET.Element) -> str:
    """An element's text as a reader sees it, markup dropped."""
    t = tag(el)
    if t == "citerefentry":
        title = el.find("refentrytitle")
        vol = el.find("manvolnum")
        name = inline(title) if title is not None else ""
        return f"{name}({(vol.text or '') if vol is not None else ''})"
    if t == "ulink" and not "".join(el.itertext()).strip():
        return el.get("url", "")
    if t == "arg":
        body = (el.text or "") + "".join(inline(c) + (c.tail or "") for c in el)
        body = body.strip()
        if el.get("rep") == "repeat":
            body += "..."
        return f"[{body}]" if el.get("choice", "opt") == "opt" else body
    if t == "group":
        parts = [inline(c).strip("[]") for c in el]
        body = " | ".join(parts)
        return f"[{body}]" if el.get("choice", "opt") == "opt" else f"{{{body}}}"
    out = el.text or ""
    for child in el:
        out += inline(child) + (child.tail or "")
    return out


def flat(el: ET.Element) -> str:
    return _SPACE.sub(" ", inline(el)).strip()


def blocks(el: ET.Element, depth: int) -> list[str]:
    """Markdown paragraphs of a section-level element's children."""
    out: list[str] = []
    for child in el:
        t = tag(child)
        if t == "title":
            continue
        if t in ("refsect1", "refsect2", "refsect3"):
            level = {"refsect1": 2, "refsect2": 3, "refsect3": 4}[t]
            title = child.find("title")
            out.append("#" * level + " " + (flat(title) if title is not None else ""))
            out.extend(blocks(child, level))
        elif t == "para":
            out.extend(para(child))
        elif t == "variablelist":
            for entry in child.iter("varlistentry"):
                terms = [f"`{flat(term)}`" for term in entry.findall("term")]
                out.append(", ".join(terms))
                item = entry.find("listitem")
                if item is not None:
                    out.extend(blocks(item, depth))
        elif t in ("itemizedlist", "orderedlist", "simplelist"):
            items = child.findall("listitem") + child.findall("member")
            lines = []
            for n, item in enumerate(items, start=1):
                body = blocks(item, depth) if tag(item) == "listitem" else [flat(item)]
                mark = f"{n}." if t == "orderedlist" else "-"
                text = "\n  ".join(body) if body else ""
                lines.append(f"{mark} {text}")
            out.append("\n".join(lines))
        elif t in ("programlisting", "screen", "literallayout"):
            code = inline(child).strip("\n")
            out.append(f"```\n{code}\n```")
        elif t in ("example", "important", "note"):
            title = child.find("title")
            label = flat(title) if title is not None else t.capitalize()
            inner = blocks(child, depth)
            if t != "example" and inner:
                inner[0] = f"{label}: {inner[0]}"
            elif title is not None:
                inner.insert(0, f"{label}:")
            out.extend(inner)
        elif t == "informaltable":
            rows = [[flat(e) for e in row.findall("entry")] for row in child.iter("row")]
            if rows:
                out.append(f"| {' | '.join(rows[0])} |")
                out[-1] += "\n|" + "---|" * len(rows[0])
                for row in rows[1:]:
                    out[-1] += f"\n| {' | '.join(row)} |"
        elif t == "cmdsynopsis":
            out.append(flat(child))
        else:
            text = flat(child)
            if text:
                out.append(text)
    return out


def para(el: ET.Element) -> list[str]:
    """A paragraph, split around any block it holds (a list or code in a para)."""
    out: list[str] = []
    text = el.text or ""
    for child in el:
        if tag(child) in BLOCKS:
            if text.strip():
                out.append(_SPACE.sub(" ", text).strip())
            holder = ET.Element("x")
            holder.append(child)
            out.extend(blocks(holder, 0))
            text = child.tail or ""
        else:
            text += inline(child) + (child.tail or "")
    if text.strip():
        out.append(_SPACE.sub(" ", text).strip())
    return out


def convert(xml: str) -> str:
    root = ET.fromstring(xml)
    name = flat(root.find("refnamediv/refname"))
    purpose = flat(root.find("refnamediv/refpurpose"))
    vol = flat(root.find("refmeta/manvolnum"))
    out = [f"# {name}({vol})", f"{name} - {purpose}"]
    synopsis = root.find("refsynopsisdiv")
    if synopsis is not None:
        out.append("## Synopsis")
        out.extend(blocks(synopsis, 2))
    for child in root:
        if tag(child) in ("refsect1",):
            holder = ET.Element("x")
            holder.append(child)
            out.extend(blocks(holder, 1))
    return "\n\n".join(out) + "\n"


def main() -> None:
    git_dir, commit = sys.argv[1], sys.argv[2]
    docs = Path(__file__).resolve().parent / "docs"
    for page in PAGES:
        xml = subprocess.run(
            ["git", f"--git-dir={git_dir}", "show", f"{commit}:man/{page}.xml"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        name = page.rsplit(".", 1)[0].replace(".", "_").replace("-", "_")
        (docs / f"man_{name}.md").write_text(convert(xml), encoding="utf-8")


if __name__ == "__main__":
    main()
