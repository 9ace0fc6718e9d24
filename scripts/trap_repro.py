"""Several processes on one GPU whose kernels trap at about the same time: does every process's
``torch.cuda.synchronize()`` return the error? A check of the CUDA driver with nothing of the TP
path but its wait kernel: each process runs only ``rank_wait`` on a device-memory header of its
own (nothing shared between the processes, nothing host-mapped), whose wait gives up and traps,
as a TP rank's does when a peer leaves (docs/TP.md, TP-4). docs/DESIGN.md's Known limits cites
its result.

    python scripts/trap_repro.py [--procs 2,3,4] [--mode left|timeout] [--deadline 60] [--device cpu]

``left``: the header says rank 1 left, so the kernel traps at once; ``timeout``: the kernels spin
(sleeping between reads) for 2 s, all processes' side by side, then trap. Each process prints the
seconds its synchronize took to raise; one that has not raised by ``--deadline`` is killed and
counted as hung. Exits 1 when any process hung or did not raise.
"""
import argparse
import multiprocessing as mp
import os
import time

KWORDS, KLEFT = 512, 16 + 64  # rank_sync.h: the header's words, rank 0's left flag


def worker(mode: str, device: str, start_at: float, queue) -> None:
    import torch
    import torch_kvcm2.ops as ops

    header = torch.zeros(KWORDS, dtype=torch.int64, device=device)
    gen = torch.ones(1, dtype=torch.int64, device=device)  # rank 1 never signals generation 1
    if mode == "left":
        header[KLEFT + 1] = 1
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    time.sleep(max(0.0, start_at - time.time()))  # every process launches at about one time
    begin = time.monotonic()
    try:
        ops.rank_wait(header, [], gen, 0, 2, 2_000_000)
        sync()
        queue.put((os.getpid(), None, time.monotonic() - begin))
    except RuntimeError as exc:
        queue.put((os.getpid(), str(exc).splitlines()[0], time.monotonic() - begin))
    os._exit(0)  # the context is lost: no teardown


def run(procs: int, mode: str, device: str, deadline: float) -> bool:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()  # put writes at once: a worker leaves by os._exit right after
    start_at = time.time() + 8.0  # after every process has made its context
    workers = [ctx.Process(target=worker, args=(mode, device, start_at, queue))
               for _ in range(procs)]
    for w in workers:
        w.start()
    results = []
    end = start_at + deadline
    while len(results) < procs and time.time() < end:
        if queue.empty():
            time.sleep(0.2)
        else:
            results.append(queue.get())
    hung = procs - len(results)
    for w in workers:
        if w.is_alive():
            w.kill()
        w.join()
    raised = [r for r in results if r[1] is not None]
    print(f"{procs} processes, {mode}: {len(raised)} raised, "
          f"{len(results) - len(raised)} returned without an error, {hung} hung past "
          f"{deadline:.0f} s; seconds to raise: "
          + ", ".join(f"{s:.2f}" for _, _, s in sorted(results, key=lambda r: r[2]))
          + (f"; error: {raised[0][1]}" if raised else ""), flush=True)
    return hung == 0 and len(raised) == procs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="2,3,4", help="process counts, comma-separated")
    p.add_argument("--mode", choices=("left", "timeout"), default="timeout")
    p.add_argument("--deadline", type=float, default=60.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the CPU kernel's wait raises instead (a check of this script)")
    args = p.parse_args()
    ok = [run(int(n), args.mode, args.device, args.deadline) for n in args.procs.split(",")]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
