"""The results page of ``skymesh_lab.bench.image_sizes``: the per-role images' sizes.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page without an image engine. Reads only the JSON it is given.
"""

from __future__ import annotations

from typing import Any

TOP = 5  # largest distributions listed per image
ROLE_ORDER = ("balancer", "controller", "replica")


def mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def _roles(doc: dict[str, Any]) -> list[str]:
    images = doc["images"]
    return sorted(images, key=lambda r: (ROLE_ORDER.index(r) if r in ROLE_ORDER else 9, r))


def sizes_table(doc: dict[str, Any]) -> str:
    base = doc["base"]
    out = ["| image | size, MB | compressed, MB | over the base, MB | site-packages, MB "
           "| Python packages |",
           "| --- | ---: | ---: | ---: | ---: | ---: |",
           f"| `{base['tag']}` (the base) | {mb(base['size_bytes'])} "
           f"| {mb(base.get('compressed_bytes'))} | - | - | - |"]
    for role in _roles(doc):
        img = doc["images"][role]
        out.append(f"| `{img['tag']}` | {mb(img['size_bytes'])} "
                   f"| {mb(img.get('compressed_bytes'))} "
                   f"| {mb(img['size_bytes'] - base['size_bytes'])} "
                   f"| {mb(img['site_packages_bytes'])} | {len(img['distributions'])} |")
    return "\n".join(out)


def imports_table(doc: dict[str, Any]) -> str:
    roles = _roles(doc)
    modules = list(doc["images"][roles[0]]["imports"]) if roles else []
    out = ["| module | " + " | ".join(roles) + " |",
           "| --- | " + " | ".join("---" for _ in roles) + " |"]
    for module in modules:
        cells = ["yes" if doc["images"][r]["imports"].get(module) else "no" for r in roles]
        out.append(f"| `{module}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def added(doc: dict[str, Any], role: str, over: str) -> dict[str, int]:
    """Distributions in ``role``'s image and not in ``over``'s: name -> bytes."""
    theirs = doc["images"][over]["distributions"]
    return {name: d["bytes"] for name, d in doc["images"][role]["distributions"].items()
            if name not in theirs}


def _largest(dists: dict[str, int]) -> str:
    top = sorted(dists.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP]
    return ", ".join(f"{name} {mb(size)}" for name, size in top) or "-"


def packages_table(doc: dict[str, Any]) -> str:
    out = ["| image | largest packages, MB | beyond the balancer's: count, MB |",
           "| --- | --- | --- |"]
    for role in _roles(doc):
        img = doc["images"][role]
        sizes = {name: d["bytes"] for name, d in img["distributions"].items()}
        extra = "-"
        if role != "balancer" and "balancer" in doc["images"]:
            more = added(doc, role, "balancer")
            extra = f"{len(more)}, {mb(sum(more.values()))}"
        out.append(f"| {role} | {_largest(sizes)} | {extra} |")
    return "\n".join(out)


def image_sizes(doc: dict[str, Any]) -> str:
    setup = doc["setup"]
    return "\n\n".join([
        sizes_table(doc),
        "Which modules import with each image's interpreter:",
        imports_table(doc),
        "Packages by the bytes their RECORD lists (before byte-compiling):",
        packages_table(doc),
        f"Measured with {setup['engine']} on {setup['date']} at commit "
        f"`{setup.get('commit') or '-'}`; MB are 10^6 bytes. Size: the layers uncompressed, "
        "what a host's disk holds once pulled; compressed: the layers gzipped, what a "
        "registry stores and a pull downloads; over the base: uncompressed.",
    ])
