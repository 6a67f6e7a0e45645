"""Can Ray's object store hold the shadow's 2x memory budget (replica + one image)? Why the images are memfds.

    python benchmarks/object_store.py --size-mib 512 --out object-store.json

A scratch experiment kept to reproduce the figures in docs/benchmarks.md ("Images in Ray's object store");
it starts its own local Ray instances (one per phase) under a temporary directory. The phases that name a
`_system_config` setting use Ray internals on purpose, to confirm the cause: the product uses none of them.

Phases (each a fresh local Ray instance, public APIs only inside the "product" path):
  a-roomy : store = ROOMY; put-after-drop (del ref; ray.put immediately), 6 cycles
  b-roomy : store = ROOMY; drop, wait until ray.available_resources()["object_store_memory"]
            is back to its level before the old put, then put; 6 cycles.
            Then (c) put/copy timings, (d) zero-copy reader restore, (e) memfd images.
  a-tight : store = S + margin; put-after-drop (Ray's create queue must absorb the async free)
  b-tight : store = S + margin; drop, wait, put.

Measurement (read-only, from the driver, outside the product path): a sampler thread reads
/proc/<writer>/status, the allocated blocks (st_blocks) of the raylet's /dev/shm plasma file
and of any other big file it holds open (fallback allocations), the writer's memfds,
/proc/meminfo (Shmem, MemAvailable), statvfs(/dev/shm) and the spill directory's size.
"shadow" = writer RssAnon above its pre-replica baseline + store file blocks + fallback
blocks + memfd blocks: the node-level memory the shadow's budget is about.
"""
import argparse
import json
import os
import re
import subprocess
import tempfile
import sys
import threading
import time
import warnings

import numpy as np
import psutil
import ray
import torch

MiB = 1 << 20
ROOT = os.environ.get("OBJECT_STORE_EXPERIMENT_DIR") or os.path.join(tempfile.gettempdir(), "zocheck-object-store")
TMP = f"{ROOT}/ray"


# ---------------------------------------------------------------- measurement helpers
def proc_status(pid="self"):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssShmem", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def meminfo():
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("MemAvailable", "Shmem", "MemFree", "Cached"):
                out[k] = int(v.split()[0]) * 1024
    return out


def shm_used():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def fd_files(pid):
    """(kind, inode, allocated bytes) for big files a process holds open."""
    res = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return res
    for fd in fds:
        p = f"/proc/{pid}/fd/{fd}"
        try:
            tgt = os.readlink(p)
            if tgt.startswith(("socket:", "pipe:", "anon_inode:")) or tgt.endswith(
                (".log", ".out", ".err")
            ):
                continue
            st = os.stat(p)
        except OSError:
            continue
        if st.st_size < MiB and "memfd:" not in tgt:
            continue
        if tgt.startswith("/dev/shm/"):
            kind = "store"
        elif tgt.startswith("/memfd:") or "memfd:" in tgt:
            kind = "memfd"
        else:
            kind = "fallback"
        res[(kind, st.st_dev, st.st_ino)] = st.st_blocks * 512
    return res


def dir_bytes(path):
    tot = 0
    for dp, _, fns in os.walk(path):
        for fn in fns:
            try:
                tot += os.stat(os.path.join(dp, fn)).st_blocks * 512
            except OSError:
                pass
    return tot


class Sampler(threading.Thread):
    """Tracks per-bucket peaks of the node-level quantities every `interval` s."""

    def __init__(self, raylet_pid, writer_pid, writer_anon_base, spill_dir, interval=0.01):
        super().__init__(daemon=True)
        self.raylet_pid, self.writer_pid = raylet_pid, writer_pid
        self.anon_base = writer_anon_base
        self.spill_dir = spill_dir
        self.interval = interval
        self.extra_pids = {}
        self.lock = threading.Lock()
        self.bucket = None
        self.peaks = {}
        self.stop_ev = threading.Event()
        self.mi0 = meminfo()
        self.shm0 = shm_used()
        self._spill = 0
        self._last_spill_scan = 0.0

    def mark(self, name):
        with self.lock:
            self.bucket = name
            self.peaks.setdefault(name, {})

    def sample(self):
        w = proc_status(self.writer_pid)
        files = fd_files(self.raylet_pid)
        files.update(fd_files(self.writer_pid))
        store = sum(v for k, v in files.items() if k[0] == "store")
        fallback = sum(v for k, v in files.items() if k[0] == "fallback")
        memfd = sum(v for k, v in files.items() if k[0] == "memfd")
        now = time.monotonic()
        if now - self._last_spill_scan > 0.1:
            self._spill = dir_bytes(self.spill_dir)
            self._last_spill_scan = now
        mi = meminfo()
        s = {
            "w_anon": w.get("RssAnon", 0),
            "w_shmem": w.get("RssShmem", 0),
            "w_rss": w.get("VmRSS", 0),
            "w_hwm": w.get("VmHWM", 0),
            "store_alloc": store,
            "fallback_alloc": fallback,
            "memfd_alloc": memfd,
            "spill_bytes": self._spill,
            "shmem_delta": mi["Shmem"] - self.mi0["Shmem"],
            "memavail_drop": self.mi0["MemAvailable"] - mi["MemAvailable"],
            "devshm_delta": shm_used() - self.shm0,
        }
        s["shadow"] = max(0, s["w_anon"] - self.anon_base) + store + fallback + memfd
        for name, pid in self.extra_pids.items():
            st = proc_status(pid)
            s[f"{name}_anon"] = st.get("RssAnon", 0)
            s[f"{name}_shmem"] = st.get("RssShmem", 0)
        return s

    def run(self):
        while not self.stop_ev.is_set():
            s = self.sample()
            with self.lock:
                if self.bucket is not None:
                    pk = self.peaks[self.bucket]
                    for k, v in s.items():
                        pk[k] = max(pk.get(k, v), v)
            time.sleep(self.interval)

    def stop(self):
        self.stop_ev.set()
        self.join()


# ---------------------------------------------------------------- actors
def _touch_status():
    return proc_status()


@ray.remote(num_cpus=0)
class Writer:
    def __init__(self, nbytes):
        torch.set_num_threads(1)
        self.n = nbytes
        self.base = proc_status()
        self.replica = torch.empty(nbytes, dtype=torch.uint8)
        self.replica.fill_(1)  # touched: every page resident
        self.ref = None
        self.level_before_put = None  # object-store available bytes before the live image's put
        self.mfd = None
        self.extra = None

    def info(self):
        return {"pid": os.getpid(), "base": self.base, "now": proc_status()}

    def _avail(self):
        return ray.available_resources().get("object_store_memory", 0.0)

    def step(self):  # "training": touch a byte per page
        self.replica[::4096].add_(1)

    def wait_visible(self, timeout=30.0):
        """Wait until the store's reported availability shows the live image (view lag)."""
        t = time.perf_counter()
        while self._avail() > self.level_before_put - self.n // 2 and time.perf_counter() - t < timeout:
            time.sleep(0.002)
        return time.perf_counter() - t

    def cycle(self, mode, gcs_address=None, wait_timeout=60.0, tol=8 * MiB, extra_wait_s=0.0):
        self.step()
        r = {"mode": mode}
        t0 = time.perf_counter()
        old_hex = self.ref.hex() if self.ref is not None else None
        self.ref = None  # drop the old image (the only reference)
        t_drop = time.perf_counter()
        if mode == "b" and old_hex is not None:
            if gcs_address is not None:  # how fast does the state API say it is gone?
                from ray.util.state import list_objects

                while True:
                    if not list_objects(address=gcs_address, filters=[("object_id", "=", old_hex)]):
                        break
                r["listobj_gone_s"] = time.perf_counter() - t_drop
            polls = 0
            while True:
                polls += 1
                if self._avail() >= self.level_before_put - tol:
                    break
                if time.perf_counter() - t_drop > wait_timeout:
                    r["wait_timeout"] = True
                    break
                time.sleep(0.002)
            r["polls"] = polls
            time.sleep(extra_wait_s)  # b-slow: is the reused slot a question of time at all?
        t1 = time.perf_counter()
        self.level_before_put = self._avail()
        self.ref = ray.put(self.replica.numpy())  # one copy: replica -> plasma
        t2 = time.perf_counter()
        r["put_visible_s"] = self.wait_visible() if mode == "b" else None
        r.update(
            wait_s=t1 - t_drop,
            put_s=t2 - t1,
            window_s=t2 - t0,
            put_GBps=self.n / (t2 - t1) / 1e9,
            avail_after_put=self._avail(),
            status=proc_status(),
        )
        return r

    def overflow(self):
        """Put a second image while the live one is still referenced: more than the store holds?"""
        t = time.perf_counter()
        try:
            extra = ray.put(self.replica.numpy())
            ok = True
        except Exception as e:  # ObjectStoreFullError etc.
            extra, ok = None, repr(e)[:200]
        dt = time.perf_counter() - t
        self.extra = extra
        return {"ok": ok, "put_s": dt, "avail": self._avail(), "status": proc_status()}

    def release_all(self):
        self.ref = None
        self.extra = None
        return True

    def ref_holder(self):
        return [self.ref]  # wrapped: the caller borrows, nothing is resolved

    def drop_and_wait(self, wait_timeout=60.0, tol=8 * MiB):
        if self.ref is None:
            return 0.0
        self.ref = None
        t = time.perf_counter()
        while self._avail() < self.level_before_put - tol and time.perf_counter() - t < wait_timeout:
            time.sleep(0.002)
        return time.perf_counter() - t

    def mutate_first_byte(self):
        self.replica[0] = (int(self.replica[0]) + 7) % 256
        return int(self.replica[0])

    # (c) ------------------------------------------------------------------
    def copy_timings(self, reps=3):
        out = {}
        dst = torch.empty(self.n, dtype=torch.uint8)
        dst.fill_(0)
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); dst.copy_(self.replica); ts.append(time.perf_counter() - t)
        out["plain_copy_GBps"] = self.n / min(ts) / 1e9
        del dst
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); c = self.replica.clone(); ts.append(time.perf_counter() - t); del c
        out["clone_fresh_GBps"] = self.n / min(ts) / 1e9
        # ray.put of the numpy view: serialisation is one memcpy into plasma
        ts, waits = [], []
        for _ in range(reps):
            waits.append(self.drop_and_wait())
            self.level_before_put = self._avail()
            t = time.perf_counter(); self.ref = ray.put(self.replica.numpy()); ts.append(time.perf_counter() - t)
        out["put_numpy_GBps_best"] = self.n / min(ts) / 1e9
        out["put_numpy_s"] = ts
        out["free_wait_s"] = waits
        return out

    def put_tensor_timing(self):
        """ray.put(torch tensor) with Ray's default serialiser (torch's pickle)."""
        self.drop_and_wait()
        self.level_before_put = self._avail()
        before = proc_status()
        t = time.perf_counter(); self.ref = ray.put(self.replica); dt = time.perf_counter() - t
        after = proc_status()
        return {
            "put_tensor_GBps": self.n / dt / 1e9,
            "put_tensor_s": dt,
            "hwm_before": before.get("VmHWM"),
            "hwm_after": after.get("VmHWM"),
            "zero_copy_env": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"),
        }

    # (e) ------------------------------------------------------------------
    def memfd_cycles(self, cycles, hold_s=0.0):
        import mmap

        self.drop_and_wait()
        res = []
        for i in range(cycles):
            if i:
                time.sleep(hold_s)
            self.step()
            t0 = time.perf_counter()
            if self.mfd is not None:  # close the old image first: 1x at peak
                mm, fd, arr = self.mfd
                del arr
                mm.close()
                os.close(fd)
                self.mfd = None
            fd = os.memfd_create(f"image{i}", os.MFD_CLOEXEC)
            os.posix_fallocate(fd, 0, self.n)
            mm = mmap.mmap(fd, self.n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            t1 = time.perf_counter()
            arr = torch.frombuffer(mm, dtype=torch.uint8)
            arr.copy_(self.replica)
            t2 = time.perf_counter()
            self.mfd = (mm, fd, arr)
            res.append({"create_s": t1 - t0, "copy_s": t2 - t1, "copy_GBps": self.n / (t2 - t1) / 1e9,
                        "window_s": t2 - t0, "status": proc_status()})
        mm, fd, arr = self.mfd
        del arr
        mm.close(); os.close(fd); self.mfd = None
        return res


@ray.remote(num_cpus=0)
class Reader:
    """The trainer's restore: ray.get the image (zero-copy map) and copy it into its own tensor."""

    def __init__(self, nbytes):
        torch.set_num_threads(1)
        self.n = nbytes
        self.model = torch.empty(nbytes, dtype=torch.uint8)
        self.model.fill_(0)

    def pid(self):
        return os.getpid()

    def restore(self, holder, expect_first, reps=3):
        ref = holder[0]
        s0 = proc_status()
        t = time.perf_counter(); arr = ray.get(ref); t_get = time.perf_counter() - t
        s1 = proc_status()
        ro = not bool(arr.flags.writeable)
        with warnings.catch_warnings(record=True) as wl:
            warnings.simplefilter("always")
            src = torch.from_numpy(arr)
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); self.model.copy_(src); ts.append(time.perf_counter() - t)
        s2 = proc_status()
        ok = int(self.model[0]) == expect_first
        del src, arr, ref, holder
        # plain anon->anon copy of the same bytes for comparison
        other = torch.empty(self.n, dtype=torch.uint8); other.fill_(3)
        tp = []
        for _ in range(reps):
            t = time.perf_counter(); self.model.copy_(other); tp.append(time.perf_counter() - t)
        del other
        return {
            "get_s": t_get,
            "readonly": ro,
            "from_numpy_warnings": [str(w.message)[:80] for w in wl],
            "first_copy_GBps": self.n / ts[0] / 1e9,
            "best_copy_GBps": self.n / min(ts) / 1e9,
            "plain_copy_GBps": self.n / min(tp) / 1e9,
            "anon_delta_get": s1.get("RssAnon", 0) - s0.get("RssAnon", 0),
            "shmem_delta_get": s1.get("RssShmem", 0) - s0.get("RssShmem", 0),
            "anon_delta_copy": s2.get("RssAnon", 0) - s0.get("RssAnon", 0),
            "shmem_after_copy": s2.get("RssShmem", 0),
            "image_is_snapshot": ok,
        }

    def check_readonly(self, holder):
        arr = ray.get(holder[0])
        r = {"type": type(arr).__name__, "writeable": bool(arr.flags.writeable)}
        del arr
        return r


# ---------------------------------------------------------------- driver
def ray_tmp_procs():
    n = 0
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(TMP in c for c in (p.info["cmdline"] or [])):
                n += 1
        except (psutil.Error, TypeError):
            pass
    return n


def start_ray(store_bytes, spill_dir, dashboard, system_config=None):
    os.makedirs(spill_dir, exist_ok=True)
    kw = {"_system_config": system_config} if system_config else {}
    ctx = ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=int(store_bytes),
        include_dashboard=dashboard,
        object_spilling_directory=spill_dir,
        _temp_dir=TMP,
        logging_level="WARNING",
        **kw,
    )
    sess = ctx.address_info["session_dir"]
    raylet = None
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "raylet" and any(sess in c for c in (p.info["cmdline"] or [])):
            raylet = p.pid
    assert raylet, "raylet not found"
    return ctx, sess, raylet


def ray_memory_stats(gcs):
    exe = os.path.join(os.path.dirname(sys.executable), "ray")
    try:
        out = subprocess.run([exe, "memory", "--stats-only", "--address", gcs],
                             capture_output=True, text=True, timeout=120).stdout
    except subprocess.TimeoutExpired:
        return "timeout"
    i = out.find("Plasma memory usage")
    return out[i:].strip() if i >= 0 else out[-600:]


def raylet_log_hits(sess):
    hits = []
    for fn in ("raylet.out", "raylet.err"):
        p = os.path.join(sess, "logs", fn)
        if os.path.exists(p):
            for line in open(p, errors="replace"):
                if "[state-dump]" in line:
                    continue
                if re.search(r"Spilled|[Ff]allback|ObjectStoreFull|spilling|out of memory", line):
                    hits.append(line.strip()[:200])
    return hits


SAMPLE_KEYS = ("store_alloc", "fallback_alloc", "spill_bytes", "shmem_delta", "memavail_drop",
               "devshm_delta", "shadow", "w_shmem")


def run_phase(name, mode, store_bytes, S, cycles, hold_s, extras=False, overflow=False,
              system_config=None, settle=3.0, extra_wait_s=0.0, tensor_put=True):
    spill_dir = f"{ROOT}/spill-{name}"
    ctx, sess, raylet = start_ray(store_bytes, spill_dir, dashboard=extras, system_config=system_config)
    res = {"phase": name, "mode": mode, "store_bytes": int(store_bytes), "store_x": store_bytes / S,
           "system_config": system_config, "cycles": []}
    try:
        gcs = ctx.address_info["gcs_address"]
        res["capacity"] = ray.cluster_resources().get("object_store_memory")
        w = Writer.remote(S)
        info = ray.get(w.info.remote())
        wpid, anon_base = info["pid"], info["base"].get("RssAnon", 0)
        res["writer_base"] = info["base"]
        smp = Sampler(raylet, wpid, anon_base, spill_dir)
        smp.start()
        smp.mark("cycles")
        if mode == "e":
            res["memfd"] = ray.get(w.memfd_cycles.remote(cycles, hold_s))
            res["cycles"] = [{"wait_s": 0.0, "put_s": m["copy_s"] + m["create_s"], "window_s": m["window_s"],
                              "put_GBps": m["copy_GBps"], "status": m["status"], "sample": m.get("sample", {})}
                             for m in res["memfd"]]
        else:
            for i in range(cycles):
                r = ray.get(w.cycle.remote(mode, gcs if (extras and i == 1) else None, extra_wait_s=extra_wait_s))
                s = smp.sample()
                r["sample"] = {k: s[k] for k in SAMPLE_KEYS}
                res["cycles"].append(r)
                time.sleep(hold_s)  # the image lives for N steps
        res["peaks_cycles"] = dict(smp.peaks["cycles"])
        smp.mark("settle")
        time.sleep(settle)
        res["settled"] = smp.sample()
        res["settled"]["avail"] = ray.available_resources().get("object_store_memory")
        if extras:
            # (d) zero-copy reader restore against the live image
            smp.mark("restore")
            rd = Reader.remote(S)
            smp.extra_pids["reader"] = ray.get(rd.pid.remote())
            holder = ray.get(w.ref_holder.remote())
            first = ray.get(w.mutate_first_byte.remote())  # the replica moves on; the image must not
            res["restore"] = ray.get(rd.restore.remote(holder, (first - 7) % 256))
            res["restore"]["get_type"] = ray.get(rd.check_readonly.remote(holder))
            del holder
            res["peaks_restore"] = dict(smp.peaks["restore"])
            ray.kill(rd)
            smp.extra_pids.pop("reader")
            # (c) put/copy timings
            smp.mark("copy")
            res["copy"] = ray.get(w.copy_timings.remote())
            res["peaks_copy"] = dict(smp.peaks["copy"])
            smp.mark("put_tensor")
            if tensor_put:  # costs 2 extra copies of anon memory
                res["put_tensor"] = ray.get(w.put_tensor_timing.remote())
            res["peaks_put_tensor"] = dict(smp.peaks["put_tensor"])
            ray.get(w.drop_and_wait.remote())
            w2 = Writer.options(runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}).remote(S)
            smp.extra_pids["w2"] = ray.get(w2.info.remote())["pid"]
            smp.mark("put_tensor_zc")
            res["put_tensor_zc"] = ray.get(w2.put_tensor_timing.remote())
            res["peaks_put_tensor_zc"] = dict(smp.peaks["put_tensor_zc"])
            ray.get(w2.drop_and_wait.remote())
            ray.kill(w2)
            smp.extra_pids.pop("w2")
        if overflow:
            # a second image while the first is live: beyond the store? (spill / fallback)
            smp.mark("overflow")
            res["overflow"] = ray.get(w.overflow.remote())
            time.sleep(2.0)
            res["overflow"]["sample"] = smp.sample()
            res["peaks_overflow"] = dict(smp.peaks["overflow"])
            ray.get(w.release_all.remote())
        # is the store footprint real node memory after the objects and the writer are gone?
        smp.mark("teardown")
        ray.get(w.release_all.remote())
        time.sleep(1.5)
        res["after_drop"] = smp.sample()
        ray.kill(w)
        time.sleep(2.0)
        res["after_writer_killed"] = smp.sample()
        smp.stop()
        res["ray_memory_stats"] = ray_memory_stats(gcs)
        res["raylet_log"] = raylet_log_hits(sess)
    finally:
        ray.shutdown()
        for _ in range(60):
            if ray_tmp_procs() == 0:
                break
            time.sleep(0.5)
        res["leftover_procs"] = ray_tmp_procs()
    return res


def summarize(S, phases):
    rows = []
    for ph in phases:
        pk, cyc = ph["peaks_cycles"], ph["cycles"]
        img = "memfd_alloc" if ph["mode"] == "e" else "store_alloc"
        later = cyc[1:]
        rows.append({
            "approach": ph["phase"],
            "store_x": ph["store_x"] if ph["mode"] != "e" else 0.0,
            "node_peak_x": pk["shadow"] / S,
            "image_alloc_x": pk[img] / S,
            "fallback_x": pk["fallback_alloc"] / S,
            "spilled_x": pk["spill_bytes"] / S,
            "shmem_delta_x": pk["shmem_delta"] / S,
            "w_RssShmem_x": pk["w_shmem"] / S,
            "w_HWM_x": pk["w_hwm"] / S,
            "w_HWM_over_base_x": (pk["w_hwm"] - ph["writer_base"].get("VmRSS", 0)) / S,
            "put_GBps_med": float(np.median([c["put_GBps"] for c in later])),
            "wait_s_max": max(c["wait_s"] for c in later),
            "window_s_med": float(np.median([c["window_s"] for c in later])),
            "window_s_max": max(c["window_s"] for c in later),
        })
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--hold-s", type=float, default=2.0, help="image lifetime between snapshots")
    ap.add_argument("--roomy-mib", type=int, default=4096)
    ap.add_argument("--margin-mib", type=int, default=32)
    ap.add_argument("--phases", default="a-roomy,b-roomy,b-roomy-slow,e-memfd,a-tight,b-tight,a-fit,b-fit,a-tight-nospill")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-tensor-put", action="store_true", help="skip ray.put(tensor) with the default serialiser")
    a = ap.parse_args()
    S = a.size_mib * MiB
    M = a.margin_mib * MiB
    tight, fit = S + M, int(S / 0.8) + M
    nospill = {"automatic_object_spilling_enabled": False}
    spec = {  # name: (mode, store bytes, extras, overflow, _system_config)
        "a-roomy": ("a", a.roomy_mib * MiB, False, False, None),
        "b-roomy": ("b", a.roomy_mib * MiB, True, False, None),
        "b-roomy-slow": ("b", a.roomy_mib * MiB, False, False, None),
        "e-memfd": ("e", 128 * MiB, False, False, None),
        # not public: Ray's unpinned-object cache flushed at once instead of every 1 s
        "a-roomy-freenow": ("a", a.roomy_mib * MiB, False, False, {"free_objects_period_milliseconds": 0}),
        "a-tight": ("a", tight, False, True, None),
        "b-tight": ("b", tight, False, False, None),
        "a-fit": ("a", fit, False, True, None),
        "b-fit": ("b", fit, False, False, None),
        "a-tight-nospill": ("a", tight, False, True, nospill),
    }
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip(),
        "nproc": os.cpu_count(), "ray": ray.__version__, "torch": torch.__version__,
        "image_bytes": S, "args": vars(a), "meminfo_start": meminfo(),
    }
    phases = []
    for name in a.phases.split(","):
        mode, store, extras, overflow, sc = spec[name]
        print(f"== {name}: store {store / MiB:.0f} MiB, image {a.size_mib} MiB", flush=True)
        phases.append(run_phase(name, mode, store, S, a.cycles, a.hold_s, extras, overflow, sc,
                                extra_wait_s=2.0 if name.endswith("-slow") else 0.0,
                                tensor_put=not a.no_tensor_put))
    rows = summarize(S, phases)
    os.makedirs(ROOT, exist_ok=True)
    out = a.out or f"{ROOT}/result-{a.size_mib}MiB-{time.strftime('%H%M%S')}.json"
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "phases": phases}, f, indent=1, default=str)
    hdr = list(rows[0].keys())
    print(f"\n{meta['date']}  {meta['cpu']}  ray {ray.__version__}  image {a.size_mib} MiB, {a.cycles} cycles, "
          f"hold {a.hold_s}s; x = multiple of the image; rates/windows over cycles 2..{a.cycles}")
    print(" | ".join(f"{h:>15}" for h in hdr))
    for r in rows:
        print(" | ".join(f"{r[h]:>15}" if isinstance(r[h], str) else f"{r[h]:>15.2f}" for h in hdr))
    for ph in phases:
        print(f"\n-- {ph['phase']} (store {ph['store_x']:.2f}x{', ' + json.dumps(ph['system_config']) if ph['system_config'] else ''})"
              " per cycle: wait_s / put_s / visible_s / image_alloc_x / spilled_x / fallback_x / writer RssShmem_x")
        for c in ph["cycles"]:
            s = c["sample"]
            if not s:
                print(f"   {c['wait_s']:.3f} / {c['put_s']:.3f}")
                continue
            vis = c.get("put_visible_s")
            print(f"   {c['wait_s']:.3f} / {c['put_s']:.3f} / {('%.3f' % vis) if vis is not None else '-'} / "
                  f"{s['store_alloc'] / S:.2f} / {s['spill_bytes'] / S:.2f} / {s['fallback_alloc'] / S:.2f} / "
                  f"{c['status'].get('RssShmem', 0) / S:.2f}"
                  + (f"  (state API says gone after {c['listobj_gone_s']:.3f}s)" if "listobj_gone_s" in c else ""))
        for k in ("settled", "after_drop", "after_writer_killed"):
            v = ph[k]
            print(f"   {k}: store_alloc_x {v['store_alloc'] / S:.2f}, memfd_x {v['memfd_alloc'] / S:.2f}, "
                  f"shmem_delta_x {v['shmem_delta'] / S:.2f}, writer RssShmem_x {v['w_shmem'] / S:.2f}")
        if "overflow" in ph:
            o = ph["overflow"]; os_ = o["sample"]; po = ph["peaks_overflow"]
            print(f"   overflow (2nd image while 1st live): ok={o['ok']} put {o['put_s']:.3f}s; peak store_alloc_x "
                  f"{po['store_alloc'] / S:.2f}, fallback_x {po['fallback_alloc'] / S:.2f}, spilled_x {po['spill_bytes'] / S:.2f}")
        print("   ray memory --stats-only: " + ph["ray_memory_stats"].replace("\n", " | ")[:300])
        for line in ph["raylet_log"][-6:]:
            print("   raylet: " + line)
        if "copy" in ph:
            c, tz, rs = ph["copy"], ph["put_tensor_zc"], ph["restore"]
            t = ph.get("put_tensor", {"put_tensor_GBps": float("nan")})
            pt, pz = ph["peaks_put_tensor"], ph["peaks_put_tensor_zc"]
            print(f"   (c) writer: plain copy {c['plain_copy_GBps']:.2f} GB/s, clone into fresh memory {c['clone_fresh_GBps']:.2f} GB/s, "
                  f"ray.put(numpy view) best {c['put_numpy_GBps_best']:.2f} GB/s {['%.3f' % x for x in c['put_numpy_s']]} s")
            print(f"       ray.put(torch tensor, default serialiser) {t['put_tensor_GBps']:.2f} GB/s, writer anon peak "
                  f"+{(pt.get('w_anon', 0) - ph['writer_base'].get('RssAnon', 0)) / S - 1:.2f}x over replica; "
                  f"with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1 {tz['put_tensor_GBps']:.2f} GB/s, anon peak +"
                  f"{(pz.get('w2_anon', 0) - ph['writer_base'].get('RssAnon', 0)) / S - 1:.2f}x over replica")
            print(f"   (d) reader: ray.get {rs['get_s'] * 1e3:.1f} ms, anon +{rs['anon_delta_get'] / MiB:.1f} MiB on get, "
                  f"readonly={rs['readonly']} ({rs['get_type']}), copy into own tensor first {rs['first_copy_GBps']:.2f} / "
                  f"best {rs['best_copy_GBps']:.2f} GB/s vs plain {rs['plain_copy_GBps']:.2f} GB/s, anon +"
                  f"{rs['anon_delta_copy'] / MiB:.1f} MiB after copy, snapshot_ok={rs['image_is_snapshot']}, "
                  f"from_numpy warnings={rs['from_numpy_warnings']}")
    print(f"\nwrote {out}; leftover ray processes under {TMP}: {ray_tmp_procs()}")


if __name__ == "__main__":
    main()
