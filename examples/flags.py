"""Command-line helpers shared by the examples: argparse types that turn bad values into usage
errors naming the flag, the one-line error for what the machine lacks, the device choice, and
the check that a run's memory fits the machine before anything is allocated."""
import argparse
import os
import sys
from typing import NamedTuple, Sequence

import torch

import torch_kvcm2 as kv

GPU = "a visible CUDA device and an extension built with CUDA kernels"


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def seed(text: str) -> int:
    """argparse type: a seed, an int in [0, 2**62) (numpy's generators refuse negative seeds,
    torch's those past 64 bits)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if not 0 <= value < 1 << 62:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 2**62)")
    return value


def given(argv: Sequence[str], *names: str) -> bool:
    """Whether any of the option strings ``names`` (e.g. "--topk", "-K") is on the command line
    ``argv``, as ``--flag VALUE``, ``--flag=VALUE`` or, for a short one, ``-KVALUE``."""
    return any(a == name or a.startswith(name + "=") or (len(name) == 2 and a.startswith(name))
               for a in argv for name in names)


def prompt_lengths(text: str) -> list:
    """argparse type: comma-separated prompt lengths, each an int >= 1."""
    try:
        return [positive_int(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: every length must be an int >= 1 "
                                         f"({error})") from None


def usage_error(message: str) -> None:
    """One line on stderr and exit status 2, as argparse does for a bad flag (without the usage
    text: the flags parse, the machine lacks what they ask for)."""
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {message}\n")
    sys.exit(2)


def cuda_usable() -> bool:
    return not kv.missing_for("cuda")


def chosen_device(choice: str) -> torch.device:
    """The device ``--device auto|cpu|cuda`` names: auto is cuda where it is usable."""
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and cuda_usable())
                        else "cpu")


def needs_gpu(what: str) -> None:
    """The usage error of a flag that needs a usable GPU where none is: ``what`` (the flag)
    needs a GPU, and everything ``torch_kvcm2.missing_for("cuda")`` finds missing."""
    usage_error(f"{what} needs a GPU ({GPU}): {'; '.join(kv.missing_for('cuda'))}")


def pick_device(choice: str) -> torch.device:
    """``chosen_device``, where cuda that is not usable is a usage error saying what is
    missing."""
    if choice == "cuda" and not cuda_usable():
        needs_gpu("--device cuda")
    return chosen_device(choice)


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when the extension has CUDA kernels and a GPU is visible")


def size(text: str) -> int:
    """argparse type: a byte count, an int with an optional K, M, G or T suffix (powers of 1024),
    e.g. 512M, 4G."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    digits, scale = (text[:-1], units[text[-1].upper()]) if text[-1:].upper() in units else (text, 1)
    try:
        value = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (an int, or with a "
                                         f"K, M, G or T suffix)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not >= 1 byte")
    return value


def human(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


class Part(NamedTuple):
    """Part of the memory a run takes: what it is, its bytes, the flags it grows with, and where
    it lives ("host", or "device": the run's device, which is host memory on the CPU)."""

    what: str
    nbytes: int
    flags: tuple
    medium: str


def available_host_bytes() -> tuple:
    """(bytes, where the figure comes from): MemAvailable of /proc/meminfo, else the physical
    memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"


def check_memory(parser: argparse.ArgumentParser, argv: Sequence[str], parts: list,
                 device: torch.device) -> None:
    """A usage error (exit status 2) when the run's memory (``parts``) exceeds what the host,
    or the GPU, has available now. It names the flags of the largest part, those given on the
    command line (``argv``) first, and lists the largest parts. Call it before allocating."""
    media = {"host": []}
    for part in parts:
        medium = "host" if part.medium == "host" or device.type != "cuda" else "device"
        media.setdefault(medium, []).append(part)
    for medium, listed in media.items():
        need = sum(part.nbytes for part in listed)
        if medium == "host":
            available, source = available_host_bytes()
            name = "host"
        elif kv.missing_for(device):
            continue  # a device this process cannot use: pick_device says what is missing
        else:
            available, _ = torch.cuda.mem_get_info(device)
            source, name = f"free on {device}, torch.cuda.mem_get_info", f"GPU ({device})"
        if need <= available:
            continue
        listed = sorted(listed, key=lambda part: -part.nbytes)
        flags = listed[0].flags
        given = [f for f in flags if any(a == f or a.startswith(f + "=") for a in argv)]
        named = given or list(flags)
        largest = "; ".join(f"{p.what} {human(p.nbytes)} ({', '.join(p.flags)})"
                            for p in listed[:3])
        parser.error(f"argument {'/'.join(named)}: this run needs about {human(need)} of {name} "
                     f"memory, more than the {human(available)} available ({source}); the largest "
                     f"parts: {largest}. Lower {' or '.join(named)}")
