"""A cell in a replica's sandbox (run by sandbox_probe): join the cgroups and take the kernel's
user id as `nbos replica` does, then `gpu` (what torch sees and can do) or `hog` (take host memory
past the limit: the OOM killer must stop this process, nothing else)."""
import json
import os
import sys

for d in filter(None, os.environ.get("NBOS_PROBE_CGROUPS", "").split(":")):
    with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write("0")
uid = int(os.environ["NBOS_PROBE_UID"])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
seen = {"uid": os.getuid(), "pid": os.getpid(),
        "processes": len([p for p in os.listdir("/proc") if p.isdigit()]),
        "secret_env": "DAEMON_SECRET" in os.environ,
        "devices": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))}
mode = sys.argv[1]
if mode == "gpu":
    import torch
    seen["cuda"] = torch.cuda.is_available()
    seen["count"] = torch.cuda.device_count()
    if seen["cuda"]:
        seen["name"] = torch.cuda.get_device_name(0)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = (a @ a).float().sum().item()
        big = torch.empty(16 << 30, dtype=torch.uint8, device="cuda")  # 16 GiB of GPU memory
        seen["matmul_finite"] = b == b
        seen["gpu_alloc_gib"] = big.numel() >> 30
        seen["max_rss_mb"] = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) >> 10
    print(json.dumps(seen), flush=True)
elif mode == "hog":
    print(json.dumps(seen), flush=True)
    chunks = []
    for i in range(64):
        chunks.append(b"\x01" * (256 << 20))
        print(f"holding {(i + 1) * 256} MB", flush=True)
