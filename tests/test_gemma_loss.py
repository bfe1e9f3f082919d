"""Chunked cross-entropy == the naive one (loss, stats, gradients; sharded too), and it
really does not keep [N, V] logits: checked on the compiled program's temporary buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.gemma.loss import chunked_cross_entropy, cross_entropy
from runtime.task import IGNORE_LABEL


def _inputs(b, t, d, v, *, hidden_dtype=jnp.float32, ignore_frac=0.25, seed=0):
    kh, ke, ky, km = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(kh, (b, t, d), jnp.float32).astype(hidden_dtype)
    embedding = jax.random.normal(ke, (v, d), jnp.float32) * 0.5
    labels = jax.random.randint(ky, (b, t), 0, v, jnp.int32)
    labels = jnp.where(jax.random.uniform(km, (b, t)) < ignore_frac, IGNORE_LABEL, labels)
    return hidden, embedding, labels


def _value_and_grads(kind, chunk_size, softcap):
    def loss(h, e, y):
        return cross_entropy(h, e, y, kind=kind, chunk_size=chunk_size, softcap=softcap)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("shape,chunk", [((2, 24, 16, 40), 16),    # 48 tokens: multiple of the chunk
                                         ((3, 7, 16, 33), 8),      # 21 tokens: padded to 24
                                         ((1, 5, 8, 16), 64)])     # chunk larger than N
def test_chunked_matches_plain_fp32(shape, chunk, softcap):
    b, t, d, v = shape
    h, e, y = _inputs(b, t, d, v)
    (lp, sp), (ghp, gep) = _value_and_grads("plain", chunk, softcap)(h, e, y)
    (lc, sc), (ghc, gec) = _value_and_grads("chunked", chunk, softcap)(h, e, y)
    assert int(sp["tokens"]) == int(jnp.sum(y != IGNORE_LABEL)) > 0
    assert int(sc["tokens"]) == int(sp["tokens"]) and int(sc["correct"]) == int(sp["correct"])
    np.testing.assert_allclose(lc, lp, rtol=1e-6)
    np.testing.assert_allclose(ghc, ghp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gec, gep, rtol=1e-5, atol=1e-6)
    # Ignored tokens get exactly no gradient.
    assert np.all(np.asarray(ghc)[np.asarray(y) == IGNORE_LABEL] == 0)


def test_loss_value_by_hand():
    h, e, y = _inputs(2, 6, 8, 12)
    logits = np.einsum("btd,vd->btv", np.asarray(h, np.float64), np.asarray(e, np.float64))
    logits = np.tanh(logits / 5.0) * 5.0
    lse = np.log(np.exp(logits).sum(-1))
    yn = np.asarray(y)
    valid = yn != IGNORE_LABEL
    want = (lse - np.take_along_axis(logits, np.where(valid, yn, 0)[..., None], -1)[..., 0])[valid].sum()
    loss, stats = jax.jit(lambda h, e, y: chunked_cross_entropy(h, e, y, chunk_size=5, softcap=5.0))(h, e, y)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert int(stats["correct"]) == int((logits.argmax(-1) == yn)[valid].sum())


def test_chunked_matches_plain_bf16_hidden():
    h, e, y = _inputs(4, 16, 32, 48, hidden_dtype=jnp.bfloat16)
    (lp, sp), (ghp, gep) = _value_and_grads("plain", 24, 30.0)(h, e, y)
    (lc, sc), (ghc, gec) = _value_and_grads("chunked", 24, 30.0)(h, e, y)
    assert lc.dtype == jnp.float32 and ghc.dtype == jnp.bfloat16
    assert {k: int(x) for k, x in sc.items()} == {k: int(x) for k, x in sp.items()}
    np.testing.assert_allclose(lc, lp, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ghc, np.float32), np.asarray(ghp, np.float32), rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(gec, gep, rtol=1e-4, atol=1e-5)


def test_unknown_kind():
    h, e, y = _inputs(1, 2, 4, 8)
    with pytest.raises(ValueError, match="unknown loss kind"):
        cross_entropy(h, e, y, kind="blockwise")


def test_chunked_never_holds_full_logits():
    """Compiled value_and_grad temporaries: plain > one [N, V] fp32 array > chunked."""
    b, t, d, v, chunk = 8, 512, 64, 8192, 512  # N = 4096 tokens: full logits are 128 MiB
    logits_bytes = b * t * v * 4
    args = (jax.ShapeDtypeStruct((b, t, d), jnp.float32), jax.ShapeDtypeStruct((v, d), jnp.float32),
            jax.ShapeDtypeStruct((b, t), jnp.int32))

    def temp_bytes(kind):
        fn = jax.value_and_grad(lambda h, e, y: cross_entropy(h, e, y, kind=kind, chunk_size=chunk, softcap=30.0)[0],
                                argnums=(0, 1))
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    plain, chunked = temp_bytes("plain"), temp_bytes("chunked")
    assert plain > logits_bytes > chunked, (plain, chunked, logits_bytes)


def test_chunked_matches_plain_sharded():
    """Embedding sharded (vocab over tensor, embed over fsdp), hidden over the batch."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    h, e, y = _inputs(8, 12, 16, 64)
    h = jax.device_put(h, NamedSharding(mesh, P("fsdp")))
    y = jax.device_put(y, NamedSharding(mesh, P("fsdp")))
    e = jax.device_put(e, NamedSharding(mesh, P("tensor", "fsdp")))
    (lp, sp), (ghp, gep) = _value_and_grads("plain", 16, 30.0)(h, e, y)
    (lc, sc), (ghc, gec) = _value_and_grads("chunked", 16, 30.0)(h, e, y)
    assert {k: int(x) for k, x in sc.items()} == {k: int(x) for k, x in sp.items()}
    np.testing.assert_allclose(lc, lp, rtol=1e-6)
    np.testing.assert_allclose(ghc, ghp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gec, gep, rtol=1e-5, atol=1e-6)


def test_the_loss_chunk_is_per_batch_device(monkeypatch):
    """arch.loss_chunk_size counts tokens on each device the batch is split over: in a step
    traced on a mesh of 4 batch devices a chunk holds 4 times as many of the flattened tokens."""
    import flax.linen as nn

    from models.gemma import task as gemma_task
    from models.gemma.config import GemmaConfig
    from runtime.sharding import activation_rules, make_mesh

    seen = []
    monkeypatch.setattr(gemma_task, "cross_entropy", lambda *a, chunk_size, **k: seen.append(chunk_size) or (
        jnp.zeros(()), {"tokens": jnp.zeros((), jnp.int32), "correct": jnp.zeros((), jnp.int32)}))
    task = gemma_task.GemmaTask(GemmaConfig(num_layers=1, embed_dim=16, hidden_dim=32, num_heads=2, num_kv_heads=1,
                                            head_dim=8, vocab_size=64, dtype="float32", loss_chunk_size=32))
    batch = {"inputs": jnp.zeros((8, 16), jnp.int32), "labels": jnp.zeros((8, 16), jnp.int32)}
    params = nn.meta.unbox(jax.eval_shape(task.init, jax.random.key(0), batch))

    def sums(p):
        with activation_rules(make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, jax.devices()[:8])):
            return task.eval_sums(p, batch)

    jax.eval_shape(sums, params)
    jax.eval_shape(task.eval_sums, params, batch)  # no mesh: the tokens of this one device
    assert seen == [32 * 4, 32]
