"""An MLPerf system description (systems/<system>.json): what this machine says about itself,
merged with a file the submitter edits for what no program can know.

    probe()  CPU, cores, memory, storage, network cards, accelerators, OS, framework versions
    merge()  the submitter's file over the probe (a value they wrote wins; an empty one does not erase)
    check()  every field the checker requires is there, and the ones it wants answered are answered

The file may be one MLCommons' `mlperf-sysinfo capture` wrote (the same flat fields): gptj fills
what it left blank and it knows (framework, software stack)."""

from __future__ import annotations

import json
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path

import gptj
from gptj.errors import GptjError
from gptj.files import atomic_write_json

# The checker's SYSTEM_DESC_REQUIRED_FIELDS, and the subset that needs a meaningful (non-empty) answer
# (tools/submission/submission_checker/constants.py).
REQUIRED = (
    "division", "submitter", "status", "system_name", "number_of_nodes", "host_processor_model_name",
    "host_processors_per_node", "host_processor_core_count", "host_memory_capacity", "host_storage_capacity",
    "host_storage_type", "accelerators_per_node", "accelerator_model_name", "accelerator_memory_capacity",
    "framework", "operating_system", "system_type", "other_software_stack", "host_processor_frequency",
    "host_processor_caches", "host_memory_configuration", "host_processor_interconnect", "host_networking",
    "host_networking_topology", "accelerator_frequency", "accelerator_host_interconnect",
    "accelerator_interconnect", "accelerator_interconnect_topology", "accelerator_memory_configuration",
    "accelerator_on-chip_memories", "cooling", "hw_notes", "sw_notes", "host_network_card_count",
    "system_type_detail",
)
MEANINGFUL = (
    "division", "submitter", "system_type", "status", "system_name", "number_of_nodes", "host_processor_model_name",
    "host_processors_per_node", "host_processor_core_count", "host_memory_capacity", "host_memory_configuration",
    "host_storage_capacity", "host_storage_type", "host_networking", "host_network_card_count",
    "host_networking_topology", "accelerators_per_node", "accelerator_model_name", "accelerator_memory_capacity",
    "accelerator_host_interconnect", "accelerator_memory_configuration", "accelerator_interconnect", "cooling",
    "framework", "operating_system", "other_software_stack",
)
# What the submission's flags set: the file may repeat them, not contradict them.
FROM_FLAGS = ("submitter", "system_name", "division", "system_type")
NOT_APPLICABLE = "N/A"


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _cpuinfo() -> tuple[str, int, int]:
    """(model name, sockets, physical cores per socket) from /proc/cpuinfo; the platform's otherwise."""
    name, sockets, cores = "", set(), set()
    phys = "0"
    for line in _read("/proc/cpuinfo").splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and not name:
            name = value
        elif key == "physical id":
            phys = value
            sockets.add(value)
        elif key == "core id":
            cores.add((phys, value))
    n_sockets = max(1, len(sockets))
    per_socket = len(cores) // n_sockets if cores else (os.cpu_count() or 1) // n_sockets
    return name or platform.processor() or platform.machine(), n_sockets, max(1, per_socket)


def _max_mhz() -> str:
    text = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").strip()
    if text.isdigit():
        return f"{int(text) // 1000} MHz"
    return ""


def _caches() -> str:
    out = []
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        level, kind, size = (_read(str(index / f)).strip() for f in ("level", "type", "size"))
        if level and size:
            suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
            out.append(f"L{level}{suffix} {size}")
    return ", ".join(out)


def _memory() -> str:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            kib = int(line.split()[1])
            return f"{kib / 2**20:.0f} GiB"
    return ""


def _storage() -> tuple[str, str]:
    """(capacity of the file system holding the working directory, SSD/HDD from the block devices)."""
    capacity = f"{shutil.disk_usage('.').total / 1e9:.0f} GB"
    kinds = set()
    for rot in Path("/sys/block").glob("*/queue/rotational"):
        if rot.parent.parent.name.startswith(("loop", "ram", "zram")):
            continue
        kinds.add("HDD" if _read(str(rot)).strip() == "1" else "SSD")
    return capacity, " + ".join(sorted(kinds))


def _network() -> tuple[str, str]:
    """(network kind, physical network cards) from /sys/class/net (a card has a device link)."""
    cards = [d for d in Path("/sys/class/net").glob("*") if (d / "device").exists()]
    if not cards:
        return "", ""
    kinds = {"1": "Ethernet", "32": "InfiniBand"}
    names = sorted({kinds.get(_read(str(d / "type")).strip(), "other") for d in cards})
    return ", ".join(names), str(len(cards))


def _os() -> str:
    fields = dict(line.split("=", 1) for line in _read("/etc/os-release").splitlines() if "=" in line)
    name = fields.get("PRETTY_NAME", "").strip('"')
    return f"{name} (Linux {platform.release()})" if name else f"{platform.system()} {platform.release()}"


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


PCI_DEVICES = Path("/sys/bus/pci/devices")
_PCIE_GENERATIONS = {"2.5": "1.0", "5.0": "2.0", "8.0": "3.0", "16.0": "4.0", "32.0": "5.0", "64.0": "6.0"}  # GT/s


def _pcie_link(props: object) -> str:
    """The GPU's link to the host from sysfs ("PCIe 5.0 x16"), or "" where it cannot be read."""
    try:
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, TypeError, ValueError):  # an older torch without the PCI fields
        return ""
    speed = _read(str(PCI_DEVICES / address / "current_link_speed")).split()  # "32.0 GT/s PCIe"
    width = _read(str(PCI_DEVICES / address / "current_link_width")).strip()
    generation = _PCIE_GENERATIONS.get(speed[0]) if speed else None
    return f"PCIe {generation} x{width}" if generation and width.isdigit() else ""


def _accelerators(device: object, world: int) -> dict[str, str]:
    """The accelerator fields for runs on `world` CUDA GPUs like `device` (one process per GPU)."""
    import re

    import torch

    props = torch.cuda.get_device_properties(device)
    memory = re.search(r"\b(HBM\w*|GDDR\w*)", props.name)  # e.g. "NVIDIA H100 80GB HBM3"
    one = NOT_APPLICABLE + " (one accelerator)"
    return {"accelerator_model_name": props.name, "accelerators_per_node": str(world),
            "accelerator_memory_capacity": f"{props.total_memory / 2**30:.0f} GiB",
            "accelerator_memory_configuration": memory.group(1) if memory else "",
            "accelerator_host_interconnect": _pcie_link(props),
            "accelerator_interconnect": one if world == 1 else "",
            "accelerator_interconnect_topology": one if world == 1 else ""}


def probe(device: str = "cpu", world: int = 1) -> dict[str, object]:
    """What this machine says about itself, in the checker's fields; "" where it cannot say.

    `device`: where the runs compute (a CPU-only system answers the accelerator fields N/A); on
    CUDA, `world` GPUs (--tp x --pp) are the accelerators the runs use."""
    import torch

    cpu, sockets, cores = _cpuinfo()
    storage_capacity, storage_type = _storage()
    networking, cards = _network()
    d: dict[str, object] = {key: "" for key in REQUIRED}
    d.update({
        "number_of_nodes": "1",
        "host_processor_model_name": cpu,
        "host_processors_per_node": str(sockets),
        "host_processor_core_count": str(cores),
        "host_processor_vcpu_count": str(os.cpu_count() or ""),
        "host_processor_frequency": _max_mhz(),
        "host_processor_caches": _caches(),
        "host_processor_interconnect": "" if sockets > 1 else NOT_APPLICABLE,
        "host_memory_capacity": _memory(),
        "host_storage_capacity": storage_capacity,
        "host_storage_type": storage_type,
        "host_networking": networking,
        "host_network_card_count": cards,
        # gptj's runs are one process on one node: LoadGen and the SUT share it, no network between
        "host_networking_topology": f"{NOT_APPLICABLE} (single node)",
        "operating_system": _os(),
        "framework": f"gptj {gptj.__version__}, PyTorch {torch.__version__}",
        "other_software_stack": ", ".join(f"{name} {v}" for name, v in (
            ("Python", platform.python_version()), ("mlcommons-loadgen", _version("mlcommons-loadgen")),
            ("numpy", _version("numpy"))) if v),
    })
    if device.startswith("cuda") and torch.cuda.is_available():
        d.update(_accelerators(torch.device(device), world))
        d["other_software_stack"] = f"{d['other_software_stack']}, CUDA {torch.version.cuda}"
    else:
        d.update({"accelerators_per_node": "0", **{k: NOT_APPLICABLE for k in (
            "accelerator_model_name", "accelerator_memory_capacity", "accelerator_host_interconnect",
            "accelerator_memory_configuration", "accelerator_interconnect", "accelerator_interconnect_topology",
            "accelerator_frequency", "accelerator_on-chip_memories")}})
    return d


def read_user_file(path: Path) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise GptjError(f"{path}: cannot read the system description ({e.strerror or e})") from None
    except ValueError as e:
        raise GptjError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise GptjError(f"{path}: a system description is a JSON object of fields")
    return data


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def merge(probed: dict[str, object], user: dict[str, object], flags: dict[str, str], source: str) -> dict:
    """The user's file over the probe, then the flags; a flag the file contradicts is an error."""
    for key, value in flags.items():
        theirs = user.get(key)
        if not _blank(theirs) and str(theirs).lower() != value.lower():
            raise GptjError(f"{source}: {key} is {theirs!r} but the command says {value!r}; make them agree")
    out = dict(probed)
    out.update({k: v for k, v in user.items() if not _blank(v)})
    out.update(flags)
    for key in REQUIRED:  # a field the file left blank stays present (the checker wants every one)
        out.setdefault(key, "")
    return out


def check(desc: dict[str, object], source: str) -> None:
    """The checker's system rules, so a run is not made for a description it would refuse."""
    from gptj.mlperf.rules import STATUSES

    missing = [k for k in REQUIRED if k not in desc]
    empty = [k for k in MEANINGFUL if k in desc and _blank(desc[k])]
    if missing or empty:
        what = ", ".join(missing + empty)
        raise GptjError(f"{source}: the system description needs {what} (fields no program can know: write them "
                        "in that file and run again)")
    if str(desc["status"]).lower() not in STATUSES:
        raise GptjError(f"{source}: status is {desc['status']!r}; MLPerf's are {', '.join(STATUSES)}")
    for key in ("number_of_nodes", "accelerators_per_node"):
        if not str(desc[key]).strip().isdigit():
            raise GptjError(f"{source}: {key} must be a whole number, got {desc[key]!r}")
    if "is_network" in desc:
        raise GptjError(f"{source}: is_network is for the network division; leave it out")


def resolve(path: Path, probed: dict[str, object], flags: dict[str, str]) -> dict[str, object]:
    """The system description to submit: `path` merged over the probe and checked. A missing
    `path` is written as a template (the probe, the flags, blanks to fill) and that is an error."""
    if not Path(path).is_file():
        desc = merge(probed, {}, flags, str(path))  # the probe, the flags, and the blanks to fill
        atomic_write_json(path, desc)
        blanks = ", ".join(k for k in MEANINGFUL if _blank(desc.get(k)))
        raise GptjError(f"{path}: wrote the system description this machine gives; fill in {blanks} and run again")
    desc = merge(probed, read_user_file(path), flags, str(path))
    check(desc, str(path))
    return desc
