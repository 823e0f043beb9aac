"""AMD GPUs through amd-smi / rocm-smi (names, memory) and sysfs + /dev (what is usable).

rocm-smi walks /sys/class/drm and ignores containers, cgroups and the visibility
variables, so inside a container it can list host GPUs this process cannot open
(ROCm/legacy-rocm-build#2366, #994; pytorch#131901). The devices counted here are
the KFD topology's GPU nodes whose ``/dev/dri/renderD<minor>`` node is present, with
``/dev/kfd`` present; the tools only label them. Then ``ROCR_VISIBLE_DEVICES``
filters (indices or ``GPU-<unique id>``) and ``HIP_VISIBLE_DEVICES`` (or, when it is
unset, ``CUDA_VISIBLE_DEVICES``) indexes the survivors renumbered from 0
(ROCm/ROCR-Runtime#155) — which is how setting both to the same index hides every GPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.detection import visibility
from launcher.detection.hardware import Gpu, Hardware
from launcher.planning.variables import Visibility

TOOL_TIMEOUT_S = 15


@dataclass
class KfdNode:
    node: int
    gpu_id: int
    render_minor: int | None
    gfx: str | None
    unique_id: int | None


def gfx_name(target_version: int) -> str | None:
    """KFD's gfx_target_version 90010 -> "gfx90a" (major, minor, stepping in hex)."""
    if target_version <= 0:
        return None
    major, minor = target_version // 10000, (target_version // 100) % 100
    step = target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


def _props(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def kfd_nodes(root: Path) -> list[KfdNode] | None:
    """GPU nodes of the KFD topology (CPU nodes have gpu_id 0); None without KFD sysfs."""
    base = root / "sys/class/kfd/kfd/topology/nodes"
    if not base.is_dir():
        return None
    nodes = []
    for d in sorted(base.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        if not d.name.isdigit():
            continue
        try:
            gpu_id = int((d / "gpu_id").read_text().strip() or 0)
            props = _props((d / "properties").read_text())
        except (OSError, ValueError):
            continue
        if gpu_id == 0:
            continue
        nodes.append(KfdNode(node=int(d.name), gpu_id=gpu_id,
                             render_minor=props.get("drm_render_minor"),
                             gfx=gfx_name(props.get("gfx_target_version", 0)),
                             unique_id=props.get("unique_id")))
    return nodes


def _run_json(exe: str, args: list[str]) -> Any | None:
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True,
                             timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if out.returncode != 0 or not starts:
        return None
    try:  # some versions print warnings before the JSON
        return json.JSONDecoder().raw_decode(text[min(starts):])[0]
    except ValueError:
        return None


@dataclass
class ToolCard:
    name: str | None = None
    memory: int | None = None
    node: int | None = None       # KFD node id
    gpu_id: int | None = None     # KFD gpu_id (amd-smi's kfd_id)
    uuid: str | None = None
    bus_id: str | None = None


def rocm_smi_cards(data: Any) -> list[ToolCard]:
    """Parse ``rocm-smi --showproductname --showmeminfo vram --json``: {"card0": {...}}."""
    cards = []
    if not isinstance(data, dict):
        return cards
    keys = sorted((k for k in data if k.startswith("card") and k[4:].isdigit()),
                  key=lambda k: int(k[4:]))
    for key in keys:
        c = data[key] if isinstance(data[key], dict) else {}
        name = next((c[k] for k in ("Card Series", "Device Name", "Card series", "Card SKU",
                                    "Card Model", "Card model") if c.get(k)), None)
        cards.append(ToolCard(name=name, memory=_int(c.get("VRAM Total Memory (B)")),
                              node=_int(c.get("Node ID")),
                              uuid=c.get("Unique ID") or c.get("GUID")))
    return cards


def amd_smi_cards(data: Any) -> list[ToolCard]:
    """Parse ``amd-smi list --json``: [{"gpu", "bdf", "uuid", "kfd_id", "node_id", ...}]."""
    if isinstance(data, dict):  # some versions wrap the list
        data = next((v for v in data.values() if isinstance(v, list)), [])
    if not isinstance(data, list):
        return []
    return [ToolCard(uuid=d.get("uuid"), bus_id=d.get("bdf"), gpu_id=_int(d.get("kfd_id")),
                     node=_int(d.get("node_id"))) for d in data if isinstance(d, dict)]


def _int(value: Any) -> int | None:
    try:
        return int(str(value).strip(), 0)
    except (TypeError, ValueError):
        return None


def tool_cards(path: str) -> tuple[str, list[ToolCard]]:
    """(tool name, cards) from amd-smi, with rocm-smi for names/memory; ("none", [])."""
    amd = shutil.which("amd-smi", path=path)
    rocm = shutil.which("rocm-smi", path=path)
    cards: list[ToolCard] = []
    source = "none"
    if amd:
        cards = amd_smi_cards(_run_json(amd, ["list", "--json"]))
        source = "amd-smi" if cards else source
    if rocm:
        named = rocm_smi_cards(_run_json(rocm, ["--showproductname", "--showmeminfo", "vram",
                                                "--json"]))
        if not cards:
            cards, source = named, ("rocm-smi" if named else source)
        else:
            _merge_names(cards, named)
    return source, cards


def _merge_names(cards: list[ToolCard], named: list[ToolCard]) -> None:
    by_node = {n.node: n for n in named if n.node is not None}
    for i, card in enumerate(cards):
        other = by_node.get(card.node) or (named[i] if i < len(named) else None)
        if other:
            card.name, card.memory = other.name, other.memory


def _label(node: KfdNode, pos: int, cards: list[ToolCard], n_nodes: int) -> ToolCard:
    for card in cards:
        if card.gpu_id == node.gpu_id or card.node == node.node:
            return card
    if len(cards) == n_nodes and pos < len(cards):  # same count: assume the same order
        return cards[pos]
    return ToolCard()


def detect(vis: Visibility, path: str, root: str = "/") -> Hardware:
    """AMD hardware usable by this process; no vendor when nothing AMD is present."""
    rootp = Path(root)
    source, cards = tool_cards(path)
    nodes = kfd_nodes(rootp)
    has_kfd = (rootp / "dev/kfd").exists()
    if not cards and not nodes:
        return Hardware()
    warnings: list[str] = []
    usable = _usable(rootp, nodes, cards, has_kfd)
    listed = max(len(cards), len(nodes or []))
    if listed and not usable:
        warnings.append(_unopenable(source, listed, has_kfd))
    chosen, vis_warnings = apply_visibility(usable, vis)
    warnings.extend(vis_warnings)
    gpus = tuple(Gpu(index=i, name=card.name or "AMD GPU", uuid=card.uuid,
                     memory_bytes=card.memory, arch=node.gfx if node else None,
                     physical_index=node.node if node else None, bus_id=card.bus_id)
                 for i, (node, card) in enumerate(chosen))
    return Hardware(vendor="amd", source=source if source != "none" else "sysfs", gpus=gpus,
                    listed=listed, warnings=tuple(warnings))


def _usable(rootp: Path, nodes: list[KfdNode] | None, cards: list[ToolCard],
            has_kfd: bool) -> list[tuple[KfdNode | None, ToolCard]]:
    """The GPUs this container can open (a KFD node whose render node is present, with
    /dev/kfd present), each with the tool's card that labels it."""
    if nodes:
        usable = []
        for pos, node in enumerate(nodes):
            present = node.render_minor is not None and \
                (rootp / f"dev/dri/renderD{node.render_minor}").exists()
            if present and has_kfd:
                usable.append((node, _label(node, pos, cards, len(nodes))))
        return usable
    if has_kfd:  # no KFD sysfs (unusual): count the render nodes present
        renders = sorted((rootp / "dev/dri").glob("renderD*"))
        return [(None, cards[i] if i < len(cards) else ToolCard()) for i in range(len(renders))]
    return []


def _unopenable(source: str, listed: int, has_kfd: bool) -> str:
    """The warning for GPUs a tool or sysfs lists that this container cannot open."""
    return (f"{source if source != 'none' else 'sysfs'} lists {listed} AMD GPU(s) but this "
            f"container cannot open them (/dev/kfd {'present' if has_kfd else 'missing'}, no "
            "/dev/dri/renderD* of theirs): run with --device /dev/kfd --device /dev/dri "
            "--group-add video --group-add render (Kubernetes: an amd.com/gpu resource)")


def _pick(items: list, spec: str, var: str, uid=None) -> tuple[list, str | None]:
    """Select items by a visibility list: indices, or ``GPU-<unique id>`` prefixes."""
    def match(entry: str):
        if entry.isdigit() and int(entry) < len(items):
            return items[int(entry)]
        if entry.upper().startswith("GPU-") and uid is not None:
            hits = [it for it in items
                    if uid(it) and f"GPU-{uid(it):016X}".startswith(entry.upper())]
            return hits[0] if len(hits) == 1 else None
        return None

    chosen, cut = visibility.walk(spec, match)
    if cut is None:
        return chosen, None
    return chosen, (f"{var}={spec!r}: entry {cut.entry!r} matches none of the {len(items)} "
                    "GPU(s) left at that point; it and every entry after it are ignored")


def apply_visibility(usable: list, vis: Visibility) -> tuple[list, list[str]]:
    warnings: list[str] = []
    items = list(usable)
    rocr, hip = vis.rocr_visible_devices, vis.hip_visible_devices
    hip_var = "HIP_VISIBLE_DEVICES"
    if hip is None and vis.cuda_visible_devices is not None:
        hip, hip_var = vis.cuda_visible_devices, "CUDA_VISIBLE_DEVICES"  # HIP honours it too
    if rocr is not None:
        items, w = _pick(items, rocr, "ROCR_VISIBLE_DEVICES",
                         uid=lambda it: it[0].unique_id if it[0] else None)
        warnings += [w] if w else []
    if hip is not None:
        before = len(items)
        items, w = _pick(items, hip, hip_var)
        warnings += [w] if w else []
        if rocr is not None:
            warnings.append(
                f"both ROCR_VISIBLE_DEVICES={rocr!r} and {hip_var}={hip!r} are set: ROCR "
                f"filters first and leaves {before} GPU(s) renumbered from 0, then {hip_var} "
                f"indexes those, leaving {len(items)}. Set only one of them")
    return items, warnings
