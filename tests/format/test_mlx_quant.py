"""format/quant: `keel quantize` against MLX's own affine quantizer (mx.quantize), bit for bit.

Random matrices (several seeds; normal, uniform, constant, negative-only, positive-offset, symmetric, tiny,
large-magnitude and spiky rows) at every width and group, in F32, BF16 and F16, plus a 3-D expert stack, are
written as a safetensors file, quantized by keel with a per-module plan, and compared with mx.quantize: codes,
scales and biases must be identical bytes. MLX keeps scales in the weight's dtype; with --scales set otherwise
the reference is mx.quantize in float32 with its scales and biases cast by MLX to that dtype.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np

try:
    import mlx.core as mx
except Exception as e:  # noqa: BLE001 - any import failure means the reference is missing
    print(f"FAIL: cannot import mlx.core ({e}); run tools/deps.sh to install mlx[cpu]", file=sys.stderr)
    sys.exit(1)

BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]
KEEL = os.environ.get("KEEL_BIN")
TMP = os.environ.get("KEEL_TMP", "/tmp")
if not KEEL or not os.path.exists(KEEL):
    print(f"FAIL: KEEL_BIN not set or missing ({KEEL!r})", file=sys.stderr)
    sys.exit(1)

NP_OF = {"F32": np.float32, "F16": np.float16, "U32": np.uint32, "I32": np.int32, "BF16": np.uint16}
MX_OF = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def write_st(path, tensors, meta):
    """tensors: name -> (dtype name, shape, raw bytes)."""
    header, off, blobs = {}, 0, []
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    header["__metadata__"] = meta
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_st(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    meta = h.pop("__metadata__", {})
    out = {}
    for name, e in h.items():
        s, t = e["data_offsets"]
        out[name] = (e["dtype"], tuple(e["shape"]), b[8 + n + s:8 + n + t])
    return out, meta


def mx_bytes(a):
    """Raw bytes of an MLX array (bf16 through a uint16 view)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def to_raw(w32, dt):
    """Rounds a float32 matrix to dt the way MLX does, returning (raw bytes, the MLX array)."""
    a = mx.array(w32).astype(MX_OF[dt])
    return mx_bytes(a), a


def make_matrix(rng, rows, k, dt):
    big = 1e3 if dt == "F16" else 1e20  # F16 weights (and their scales) top out at 65504
    kinds = ["normal", "uniform", "const", "neg", "pos", "sym", "tiny", "large", "spike", "zeros", "halfneg"]
    w = np.empty((rows, k), np.float32)
    for r in range(rows):
        kind = kinds[r % len(kinds)]
        if kind == "normal":
            w[r] = rng.normal(0, rng.uniform(0.01, 2), k)
        elif kind == "uniform":
            w[r] = rng.uniform(-1, 1, k)
        elif kind == "const":
            w[r] = rng.uniform(-3, 3)
        elif kind == "neg":
            w[r] = -rng.uniform(0.1, 5, k)
        elif kind == "pos":
            w[r] = rng.uniform(10, 11, k)
        elif kind == "sym":  # +-m at both ends: q0 rounds to an even code and the top code clips
            w[r] = rng.uniform(-1, 1, k)
            w[r, ::16] = 1.0
            w[r, 8::16] = -1.0
        elif kind == "tiny":  # below eps: scale is clamped to 1e-7
            w[r] = rng.uniform(-3e-8, 3e-8, k)
        elif kind == "large":
            w[r] = rng.uniform(-big, big, k)
        elif kind == "spike":
            w[r] = rng.normal(0, 0.01, k)
            w[r, rng.integers(0, k, 5)] = rng.uniform(-40, 40, 5)
        elif kind == "zeros":
            w[r] = 0
            w[r, ::3] = -0.0
        else:
            w[r] = rng.normal(0, 1, k)
            w[r, : k // 2] = -np.abs(w[r, : k // 2])
    return w


def run_keel(args):
    p = subprocess.run([KEEL, "quantize"] + args, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"FAIL: keel quantize {' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
    return p


failures = []
compared = 0


def compare(tag, got, want):
    global compared
    compared += 1
    if got != want:
        a = np.frombuffer(got, np.uint8)
        b = np.frombuffer(want, np.uint8)
        first = int(np.argmax(a != b)) if len(a) == len(b) else -1
        failures.append(f"{tag}: bytes differ ({len(a)} vs {len(b)} bytes, first at byte {first})")


def check_file(seed, in_dt, scales_flag):
    rng = np.random.default_rng(1000 * seed + len(in_dt) + (0 if scales_flag is None else 7))
    k = 384  # a multiple of every group
    sdt = scales_flag.upper() if scales_flag else in_dt
    range_dt = "F16" if "F16" in (in_dt, sdt) else in_dt
    tensors, refs, plan = {}, {}, {}
    for b in BITS:
        for g in GROUPS:
            path = f"m.b{b}.g{g}"
            w = make_matrix(rng, 22, k, range_dt)
            raw, a = to_raw(w, in_dt)
            tensors[path + ".weight"] = (in_dt, w.shape, raw)
            plan[path] = {"bits": b, "group_size": g}
            refs[path] = (a, b, g)
    # a stacked expert tensor (E, out, in) at the global width, and one the plan keeps float
    ex = np.stack([make_matrix(rng, 8, 256, range_dt) for _ in range(3)])
    raw, a = to_raw(ex, in_dt)
    tensors["experts.fc1.weight"] = (in_dt, ex.shape, raw)
    refs["experts.fc1"] = (a, 4, 64)
    keep = rng.normal(0, 1, (8, 64)).astype(np.float32)
    tensors["kept.weight"] = (in_dt, keep.shape, to_raw(keep, in_dt)[0])
    plan["kept"] = False
    norm = rng.normal(0, 1, 384).astype(np.float32)
    tensors["norm.weight"] = (in_dt, norm.shape, to_raw(norm, in_dt)[0])
    tensors["ids"] = ("I32", (5,), np.arange(5, dtype=np.int32).tobytes())

    tag = f"seed {seed} {in_dt}" + (f" --scales {scales_flag}" if scales_flag else "")
    src = os.path.join(TMP, f"mlxq_in_{seed}_{in_dt}_{scales_flag}.safetensors")
    dst = os.path.join(TMP, f"mlxq_out_{seed}_{in_dt}_{scales_flag}.safetensors")
    pfile = os.path.join(TMP, f"mlxq_plan_{seed}_{in_dt}_{scales_flag}.json")
    write_st(src, tensors, {"format": "mlx"})
    with open(pfile, "w") as f:
        json.dump(plan, f)
    args = [src, dst, "--bits", "4", "--group", "64", "--plan", pfile]
    if scales_flag:
        args += ["--scales", scales_flag]
    run_keel(args)
    out, meta = read_st(dst)

    for path, (a, b, g) in refs.items():
        if scales_flag:  # MLX quantizes in float32; its scales and biases are then cast to the requested dtype
            q, s, bi = mx.quantize(a.astype(mx.float32), group_size=g, bits=b)
            s, bi = s.astype(MX_OF[sdt]), bi.astype(MX_OF[sdt])
        else:
            q, s, bi = mx.quantize(a, group_size=g, bits=b)
        for suffix, want in ((".weight", q), (".scales", s), (".biases", bi)):
            name = path + suffix
            if name not in out:
                failures.append(f"{tag}: {name} missing from keel's output")
                continue
            dt, shape, got = out[name]
            want_dt = "U32" if suffix == ".weight" else sdt
            if dt != want_dt or tuple(shape) != tuple(want.shape):
                failures.append(f"{tag}: {name} is {dt} {shape}, MLX gives {want_dt} {tuple(want.shape)}")
                continue
            compare(f"{tag}: {name} (b{b} g{g})", got, mx_bytes(want))
    for name in ("kept.weight", "norm.weight", "ids"):
        compare(f"{tag}: {name} copied", out[name][2], tensors[name][2])
    for name in ("kept.scales", "norm.scales"):
        if name in out:
            failures.append(f"{tag}: {name} should not exist")
    q = json.loads(meta.get("quantization", "null"))
    want_q = {"group_size": 64, "bits": 4, "mode": "affine", "kept": False}
    want_q.update({p: e for p, e in plan.items() if e and (e["bits"], e["group_size"]) != (4, 64)})
    if q != want_q:
        failures.append(f"{tag}: metadata quantization {q}, expected {want_q}")
    if meta.get("format") != "mlx":
        failures.append(f"{tag}: metadata format {meta.get('format')!r}, expected 'mlx' copied from the input")
    for p in (src, dst, pfile):
        os.remove(p)


for seed in range(3):
    for in_dt in ("F32", "BF16", "F16"):
        check_file(seed, in_dt, None)
for in_dt, flag in (("F32", "bf16"), ("F32", "f16"), ("BF16", "f32"), ("F16", "bf16")):
    check_file(9, in_dt, flag)

if failures:
    print(f"FAIL: {len(failures)} of {compared} comparisons differ from MLX {mx.__version__}:", file=sys.stderr)
    for f in failures[:40]:
        print("  " + f, file=sys.stderr)
    sys.exit(1)
print(f"ok: {compared} tensors identical to mx.quantize (MLX {mx.__version__})")
