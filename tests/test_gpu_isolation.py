"""GPU tests run one after another in one process (benchmarks/gpu.sh tests): each starts from
PyTorch's defaults whatever the one before it set (tests/conftest.py's reset_cuda_state)."""
import torch

from conftest import reset_cuda_state


def test_flags_a_test_sets_are_put_back():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        reset_cuda_state()
        assert not torch.backends.cudnn.benchmark
        assert not torch.backends.cudnn.deterministic
        assert torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        reset_cuda_state()


def test_compiled_code_is_dropped(monkeypatch):
    import torch._dynamo

    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append(1))
    reset_cuda_state()
    assert calls == [1]
