"""Command-line helpers shared by the examples: argparse types that turn bad values into usage
errors naming the flag, the one-line error for what the machine lacks, and the device choice."""
import argparse
import os
import sys

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
    return kv.has_cuda_kernels() and torch.cuda.is_available()


def pick_device(choice: str) -> torch.device:
    """The device of ``--device auto|cpu|cuda``: auto is cuda where it is usable; cuda where it is
    not is a usage error."""
    if choice == "cuda" and not cuda_usable():
        usage_error(f"--device cuda needs a GPU ({GPU})")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and cuda_usable())
                        else "cpu")


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when the extension has CUDA kernels and a GPU is visible")
