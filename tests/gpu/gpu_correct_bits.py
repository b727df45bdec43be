# ../shared/gpu/gpu_correct.py (the first GPU probe, 2026-11-25) with one change: tensors are
# compared by their BITS (torch.equal of uint8 views), so a NaN equals its own exact copy, and each
# row prints how many snapshot tensors hold NaN/inf. On an H100 (2026-11-26,
# tests/gpu/results/h100-2026-11-26/correct_bits.txt) every row is exact while the snapshots hold
# NaN in 144/192 (fp32) and 96/128 (bf16) tensors: what the original reported as corruption.
# Does an async save of GPU state hold exactly the values at the call, while training goes on
# at once (in-place optimizer steps racing the staging copy)? distckpt and plain DCP, one GPU.
# usage: torchrun --nproc-per-node 1 gpu_correct.py ROOT
if __name__ == "__main__":
    import os, sys, shutil
    import torch, torch.nn as nn, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import distckpt
    ROOT = sys.argv[1]; shutil.rmtree(ROOT, ignore_errors=True); os.makedirs(ROOT)
    cuda = torch.cuda.is_available(); dev = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    d = 4096 if cuda else 256
    def build(dtype, layers, seed):
        torch.manual_seed(seed)
        m = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)]).to(dev, dtype)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=cuda)
        return m, o
    def train(m, o, n):
        x = torch.randn(64, d, device=dev, dtype=next(m.parameters()).dtype)
        for _ in range(n):
            m(x).float().pow(2).mean().backward(); o.step(); o.zero_grad()
    def flat(m, o):
        ms, os_ = get_state_dict(m, o)
        out = {f"m.{k}": v.detach().clone() for k, v in ms.items()}
        for pk, st in os_["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v): out[f"o.{pk}.{k}"] = v.detach().clone()
        return out
    def beq(x, y):
        x = x.detach().cpu().contiguous(); y = y.detach().cpu().contiguous()
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
    def nonfinite(s):
        return sum(1 for v in s.values() if v.is_floating_point() and not torch.isfinite(v).all())
    def compare(a, b):
        bad = [k for k in a if not beq(a[k], b[k])]
        return bad
    fails = 0
    for dtype, layers in [(torch.float32, 24), (torch.bfloat16, 16)]:
        for lib in ("distckpt", "dcp"):
            m, o = build(dtype, layers, 1); train(m, o, 2)
            if cuda: torch.cuda.synchronize()
            snap = flat(m, o)
            path = f"{ROOT}/{lib}-{dtype}"
            if lib == "distckpt":
                ck = distckpt.Checkpointer(path)
                for i in range(3):  # third save: warm buffers, steady state
                    if i == 2:
                        if cuda: torch.cuda.synchronize()
                        snap = flat(m, o)
                    ck.save(i, {"model": m, "optim": o}, blocking=False)
                    train(m, o, 5)          # in place, at once, no sync
                    if i < 2: ck.wait()
                ck.wait(); ck.close()
            else:
                ms, os_ = get_state_dict(m, o)
                f = dcp.async_save({"model": ms, "optim": os_}, checkpoint_id=path)
                train(m, o, 5)
                getattr(f, "upload_completion", f).result()
            if lib == "distckpt":
                # what the files hold, read by plain DCP on the CPU (no distckpt load path)
                import glob
                from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
                step_dir = sorted(glob.glob(f"{path}/**/.metadata", recursive=True), key=os.path.getmtime)[-1].rsplit("/", 1)[0]
                dcp_to_torch_save(step_dir, f"{ROOT}/x.pt")
                raw = torch.load(f"{ROOT}/x.pt", weights_only=False); os.remove(f"{ROOT}/x.pt")
                fl = {}
                def walk(pfx, v):
                    if isinstance(v, dict):
                        for k, w in v.items(): walk(f"{pfx}.{k}" if pfx else str(k), w)
                    elif torch.is_tensor(v): fl[pfx] = v
                walk("", raw)
                found = {k: fl.get("model." + k[2:]) for k in snap if k.startswith("m.")}
                bad_files = [k for k, v in found.items() if v is None or not beq(v, snap[k])]
                print(f"  files vs call-time model weights: {len(bad_files)}/{len(found)} differ (keys sample {list(fl)[:2]})", flush=True)
            m2, o2 = build(dtype, layers, 2); train(m2, o2, 1)
            if lib == "distckpt":
                ck = distckpt.Checkpointer(path); ck.load({"model": m2, "optim": o2})
                nosync = compare(snap, flat(m2, o2))  # no synchronize: what the default stream sees at once
                if cuda: torch.cuda.synchronize()
                print(f"  load, compared at once on the default stream: {len(nosync)} differ", flush=True)
                ck.close()
            else:
                ms, os_ = get_state_dict(m2, o2); s = {"model": ms, "optim": os_}
                dcp.load(s, checkpoint_id=path)
                set_state_dict(m2, o2, model_state_dict=s["model"], optim_state_dict=s["optim"])
            bad = compare(snap, flat(m2, o2))
            gb = sum(v.numel() * v.element_size() for v in snap.values()) / 1e9
            print(f"  snapshot tensors holding NaN/inf: {nonfinite(snap)}/{len(snap)}; compared BITWISE", flush=True)
            print(f"{lib:8s} {str(dtype):15s} {gb:.2f} GB: {'OK' if not bad else f'MISMATCH in {len(bad)}/{len(snap)} tensors, e.g. {bad[:3]}'}", flush=True)
            fails += bool(bad)
            del m, o, m2, o2, snap
            if cuda: torch.cuda.empty_cache()
    print(f"correctness: {fails} mismatching runs")
    dist.destroy_process_group()
