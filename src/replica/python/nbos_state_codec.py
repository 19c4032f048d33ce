"""Arrays and tensors as bytes: the numpy/torch codec of namespace deltas.

Contract
--------
    numpy_module(), torch_module()   # the module if the kernel imported it, else None (this
                                     # module never imports them itself)
    array_layout(a)                  # (C-contiguous source, fortran flag): F-ordered arrays are
                                     # stored transposed, without a copy
    array_bytes(a), array_digest(a)  # a flat uint8 view/copy of the data; (sha256, fortran,
                                     # shape, dtype.str)
    array_from_bytes(data, dtype, shape, fortran, writable=True, owned=False)
    tensor_bytes(t)                  # a flat uint8 numpy view of a host copy of t's data
    tensor_from_bytes(data, dtype, shape, writable=True, owned=False)
    tensor_fp(t, with_grad=True)     # a cheap fingerprint: (_version, data_ptr, shape, stride,
                                     # offset, dtype, device, requires_grad, content sample
                                     # [, grad's fingerprint])
    is_plain_tensor(torch, t)        # strided, not quantized/nested/meta: replicated by token
    tensor_device(torch, name)       # the device to rebuild on (CPU when CUDA is absent)
    writable(data)                   # whether a buffer is writable (so an array may keep it)

`owned`: the caller hands over a writable buffer no one else uses, and the result may keep it as
its memory instead of copying. Tensors up to 1 MiB are fingerprinted by all their bytes, larger
ones by ~1024 evenly spaced elements and the last one (this catches writes through `.data`,
which do not bump `_version`).
"""

import hashlib
import sys
import warnings

_EXACT_TENSOR_FP_BYTES = 1 << 20  # tensors up to this size are fingerprinted by all their bytes
_SAMPLE_ELEMENTS = 1024


def numpy_module():
    return sys.modules.get("numpy")


def torch_module():
    t = sys.modules.get("torch")
    return t if t is not None and hasattr(t, "Tensor") else None


def array_layout(a):
    """(C-contiguous source, fortran flag): F-ordered arrays are stored transposed, no copy."""
    if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
        return a.T, True
    return a, False


def array_bytes(a):
    """A flat uint8 view (or copy, when not contiguous) of an array's data."""
    np = numpy_module()
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def array_digest(a):
    src, fortran = array_layout(a)
    h = hashlib.sha256(memoryview(array_bytes(src)))
    return (h.digest(), fortran, a.shape, a.dtype.str)


def array_from_bytes(data, dtype, shape, fortran, writable=True, owned=False):
    """An array over `data`: a copy of it if `writable`, unless `owned` (a writable buffer no
    one else uses, so the array may keep it)."""
    np = numpy_module()
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return np.empty(shape, dtype)
    buf = bytearray(data) if writable and not owned else data
    a = np.frombuffer(buf, dtype=dtype, count=n)
    return a.reshape(tuple(reversed(shape))).T if fortran else a.reshape(shape)


def writable(data):
    """Whether `data` is a writable buffer (the C++ store hands out a fresh one per get)."""
    try:
        return not memoryview(data).readonly
    except TypeError:
        return False


def is_plain_tensor(torch, t):
    try:
        return (t.layout is torch.strided and not t.is_quantized
                and not getattr(t, "is_nested", False) and t.device.type != "meta")
    except Exception:
        return False


def tensor_bytes(t):
    """A flat uint8 numpy view of a (host copy of a) tensor's data."""
    torch = torch_module()
    c = t.detach()
    if c.device.type != "cpu":
        c = c.cpu()
    if c.is_conj():
        c = c.resolve_conj()
    if c.is_neg():
        c = c.resolve_neg()
    c = c.contiguous().reshape(-1)
    if c.numel() == 0:
        return numpy_module().empty(0, dtype=numpy_module().uint8)
    return c.view(torch.uint8).numpy()


def tensor_from_bytes(data, dtype, shape, writable=True, owned=False):
    """As _array_from_bytes, for a torch tensor."""
    torch = torch_module()
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if writable:
        buf = data if owned else bytearray(data)
        return torch.frombuffer(buf, dtype=dtype, count=n).reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only source used only as a copy_ source
        return torch.frombuffer(data, dtype=dtype, count=n).reshape(shape)


def tensor_sample(t):
    """Hash of all bytes (small tensors) or of ~1024 evenly spaced elements (large ones)."""
    n = t.numel()
    nbytes = n * t.element_size()
    if nbytes <= _EXACT_TENSOR_FP_BYTES:
        return hashlib.sha256(memoryview(tensor_bytes(t))).digest()
    if not t.is_contiguous():
        return None
    flat = t.detach().reshape(-1)
    step = max(1, n // _SAMPLE_ELEMENTS)
    sample = flat[::step][:_SAMPLE_ELEMENTS]
    tail = flat[-1:]
    return (hashlib.sha256(memoryview(tensor_bytes(sample))).digest()
            + hashlib.sha256(memoryview(tensor_bytes(tail))).digest())


def tensor_fp(t, with_grad=True):
    try:
        version = t._version
    except Exception:  # inference tensors have no version counter
        version = None
    fp = (version, t.data_ptr(), tuple(t.shape), t.stride(), t.storage_offset(), str(t.dtype),
          str(t.device), t.requires_grad, tensor_sample(t))
    if with_grad and t.is_leaf:
        g = t.grad
        fp += (None if g is None else tensor_fp(g, False),)
    return fp


def tensor_device(torch, name):
    try:
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            return torch.device("cpu")
        return dev
    except Exception:
        return torch.device("cpu")
