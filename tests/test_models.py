"""Every Lipschitz component respects its claimed constant; structure matches the forward pass."""

import json
import math

import pytest
import torch

from lofast.config import PRESETS, ModelConfig, preset
from lofast.errors import LofastError
from lofast.models.layers import (
    SLL,
    Attention,
    Head,
    LayerProject,
    PatchEmbed,
    Pool,
    spectral_cap,
)
from lofast.models.vit import create_model, with_options

SLACK = 1e-5


def max_ratio(f, make_input, trials=200, ascent_steps=60, seed=0):
    """Largest ||f(a) - f(b)|| / ||a - b|| over random pairs and pairs optimised to increase it
    (all pairs in one batch: Adam's steps are elementwise, so each pair ascends on its own)."""
    g = torch.Generator().manual_seed(seed)
    a = make_input(trials, g).double()
    b = a + 1e-2 * torch.randn(a.shape, generator=g, dtype=a.dtype)
    a.requires_grad_(True)
    b.requires_grad_(True)
    opt = torch.optim.Adam([a, b], lr=1e-2)
    best = torch.zeros((), dtype=torch.float64)
    for _ in range(ascent_steps):
        out_diff = (f(a) - f(b)).flatten(1)
        ratio = (torch.linalg.vector_norm(out_diff, dim=1)
                 / torch.linalg.vector_norm((a - b).flatten(1), dim=1).clamp_min(1e-12))
        best = torch.maximum(best, ratio.detach().max())
        opt.zero_grad()
        (-ratio.sum()).backward()
        opt.step()
    return best.item()


def tokens(n=5, d=16, scale=2.0):
    return lambda batch, g: scale * torch.randn(batch, n, d, generator=g)


@pytest.mark.parametrize("radius", [0.5, 1.0, 4.0])
def test_layer_project_is_1_lipschitz_and_projects(radius):
    layer = LayerProject(radius)
    assert max_ratio(layer, tokens()) <= 1 + SLACK
    x = 10 * torch.randn(8, 5, 16)
    assert torch.linalg.vector_norm(layer(x), dim=-1).max() <= radius * (1 + 1e-6)
    small = torch.randn(8, 5, 16)
    small = small / torch.linalg.vector_norm(small, dim=-1, keepdim=True) * radius * 0.5
    assert torch.equal(layer(small), small)


def test_sll_is_1_lipschitz_even_with_large_weights():
    torch.manual_seed(0)
    layer = SLL(16, 32).double()
    with torch.no_grad():
        layer.weight.mul_(5.0)
        layer.log_q.normal_()
        layer.bias.normal_()
    assert max_ratio(layer, tokens()) <= 1 + SLACK
    spec = layer.spec()
    assert torch.linalg.eigvalsh(torch.diag(spec.t) - spec.weight.T @ spec.weight)[0] >= 0


def test_patch_embed_is_cap_lipschitz():
    torch.manual_seed(0)
    layer = PatchEmbed(16, 3, 8, 24, cap=0.7, center=0.5).double()
    with torch.no_grad():
        layer.weight.mul_(3.0)
    ratio = max_ratio(layer, lambda b, g: torch.rand(b, 3, 16, 16, generator=g))
    assert ratio <= 0.7 * (1 + SLACK)
    assert ratio >= 0.6  # the ascent finds close to the cap: the test can fail


@pytest.mark.parametrize("cap", [0.25, 1.0, 3.0])
def test_spectral_cap_holds_for_effective_weights(cap):
    torch.manual_seed(1)
    for scale in (0.01, 1.0, 50.0):
        w = scale * torch.randn(32, 48)
        sigma = torch.linalg.matrix_norm(spectral_cap(w, cap), ord=2).item()
        assert sigma <= cap * (1 + SLACK)
        if torch.linalg.matrix_norm(w, ord=2) <= cap:
            assert torch.equal(spectral_cap(w, cap), w)


def test_attention_effective_weights_respect_caps():
    torch.manual_seed(2)
    attn = Attention(32, 4, query_key_cap=0.8, value_cap=0.4, output_cap=0.6)
    with torch.no_grad():
        for p in attn.weights.values():
            p.mul_(7.0)
    w = attn.effective_weights()
    caps = {"query": 0.8, "key": 0.8, "value": 0.4, "output": 0.6}
    for name, cap in caps.items():
        assert torch.linalg.matrix_norm(w[name], ord=2) <= cap * (1 + SLACK)
    spec = attn.spec()
    per_head = torch.linalg.matrix_norm(spec.value @ spec.output, ord=2)
    assert per_head.max() <= 0.4 * 0.6 * (1 + SLACK)


def test_attention_spec_reproduces_forward():
    """The per-head spec is exactly the map the module computes (what LoFAST bounds)."""
    torch.manual_seed(3)
    attn = Attention(32, 4, 1.0, 0.5, 0.5).double()
    x = torch.randn(3, 6, 32, dtype=torch.float64)
    s = attn.spec()
    q = torch.einsum("bnd,hde->bhne", x, s.query)
    k = torch.einsum("bmd,hde->bhme", x, s.key)
    scores = torch.einsum("bhne,bhme->bhnm", q, k) / s.scale
    probs = scores.softmax(-1)
    expected = x + torch.einsum("bhnm,bmd,hde,hef->bnf", probs, x, s.value, s.output)
    torch.testing.assert_close(attn(x), expected)


def test_position_bias_enters_the_scores_and_the_spec():
    torch.manual_seed(4)
    attn = Attention(32, 4, 1.0, 0.5, 0.5, num_tokens=6).double()
    assert torch.equal(attn.position_bias, torch.zeros(4, 6, 6))  # uniform reference at start
    with torch.no_grad():
        attn.position_bias.normal_(0.0, 2.0)
    x = torch.randn(3, 6, 32, dtype=torch.float64)
    s = attn.spec()
    assert torch.equal(s.position_bias, attn.position_bias.detach())
    q = torch.einsum("bnd,hde->bhne", x, s.query)
    k = torch.einsum("bmd,hde->bhme", x, s.key)
    scores = torch.einsum("bhne,bhme->bhnm", q, k) / s.scale

    def block(probs):
        return x + torch.einsum("bhnm,bmd,hde,hef->bnf", probs, x, s.value, s.output)

    torch.testing.assert_close(attn(x), block((scores + s.position_bias).softmax(-1)))
    assert not torch.allclose(attn(x), block(scores.softmax(-1)))  # the bias matters


def test_adding_position_biases_keeps_the_function():
    model = create_model(preset("tiny"), seed=0).double()
    extended = with_options(model, position_bias=True)
    assert extended.config.position_bias and not model.config.position_bias
    x = torch.rand(4, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(extended(x), model(x), rtol=0, atol=0)
    biases = [name for name, _ in extended.named_parameters() if "position_bias" in name]
    assert len(biases) == model.config.depth


def test_pool_and_head_constants():
    pool = Pool("mean", 9)
    ratio = max_ratio(pool, tokens(n=9))
    assert ratio <= 1 / math.sqrt(9) * (1 + SLACK)
    head = Head(16, 10)
    torch.testing.assert_close(torch.linalg.vector_norm(head.effective_weight(), dim=1),
                               torch.ones(10))


def test_a_plain_head_keeps_its_rows_through_a_checkpoint(tmp_path):
    from lofast.checkpoint import load_checkpoint, save_checkpoint

    config = preset("tiny", normalized_head=False)
    assert json.loads(config.to_json())["normalized_head"] is False
    model = create_model(config, seed=0)
    with torch.no_grad():
        model.stages[-1].weight.mul_(5.0)
    assert torch.equal(model.stages[-1].effective_weight(), model.stages[-1].weight)
    save_checkpoint(tmp_path / "plain.safetensors", model)
    loaded = load_checkpoint(tmp_path / "plain.safetensors")
    assert loaded.config == config and not loaded.stages[-1].normalized
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(x), model.eval()(x))
    # a config written before the field existed reads as the normalised head
    written = json.loads(preset("tiny").to_json())
    del written["normalized_head"]
    assert ModelConfig.from_dict(written).normalized_head is True
    with pytest.raises(LofastError, match="normalized_head must be true or false"):
        preset("tiny", normalized_head="no")


def test_structure_matches_forward_and_activations():
    model = create_model(preset("tiny"), seed=0).double()
    x = torch.rand(4, 3, 32, 32, dtype=torch.float64)
    logits, acts = model.forward_with_activations(x)
    torch.testing.assert_close(logits, model(x))
    specs = model.structure()
    assert len(specs) == len(acts) == len(model.stages)
    assert acts[0] is x
    names = [type(s).__name__ for s in specs]
    assert names[0] == "EmbedSpec" and names[-1] == "HeadSpec"
    assert names.count("AttentionSpec") == model.config.depth
    for spec in specs:
        for value in vars(spec).values():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.float64 and not value.requires_grad


def test_presets_are_valid_and_bad_configs_fail():
    for name, config in PRESETS.items():
        assert config.num_tokens == (config.image_size // config.patch_size) ** 2 + 1, name
    assert preset("paper-d3").depth == 3 and preset("paper-d3").width == 128
    assert preset("paper-w384").width == 384
    assert preset("lofast-p4").num_tokens == 65 and preset("lofast-p4").position_bias
    with pytest.raises(LofastError):
        ModelConfig(patch_size=5)
    with pytest.raises(LofastError):
        ModelConfig(width=30, heads=4)
    with pytest.raises(LofastError):
        preset("nope")


@pytest.mark.parametrize("gain, query_key", [(0.5, "learned"), (4.0, "learned"),
                                             (4.0, "identity")])
def test_score_norm_fixes_every_heads_score_matrix(gain, query_key):
    model = create_model(preset("tiny", score_norm=gain, query_key=query_key), seed=0).double()
    for training, tolerance in ((False, 1e-7), (True, 1e-2)):  # training: estimated norms
        model.train(training)
        for stage in model.stages:
            if hasattr(stage, "head_weights"):
                w = stage.head_weights()
                scores = w["query"] @ w["key"].transpose(1, 2)  # (h, d, d)
                torch.testing.assert_close(torch.linalg.matrix_norm(scores, ord=2),
                                           torch.full((stage.heads,), gain, dtype=torch.float64),
                                           rtol=tolerance, atol=0)


def test_score_norm_can_be_added_to_a_trained_model():
    model = create_model(preset("tiny"), seed=0).double()
    alive = with_options(model, score_norm=2.0)
    assert alive.config.score_norm == 2.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), alive.parameters()))
    with pytest.raises(LofastError, match="take on only"):
        with_options(model, heads=1)


def test_a_trained_head_can_be_freed_from_its_unit_rows():
    model = create_model(preset("tiny"), seed=0).double().eval()
    with torch.no_grad():
        model.stages[-1].weight.mul_(3.0)  # stored rows need not have unit norm
    freed = with_options(model, normalized_head=False).eval()
    assert not freed.stages[-1].normalized
    torch.testing.assert_close(torch.linalg.vector_norm(freed.stages[-1].weight, dim=1),
                               torch.ones(10, dtype=torch.float64))
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(freed(x), model(x))  # the same function
    with pytest.raises(LofastError, match="take on only"):
        with_options(freed, normalized_head=True)


def test_identity_query_key_drops_the_learned_weights():
    model = create_model(preset("tiny"), seed=0)
    similar = with_options(model, query_key="identity", score_norm=1.0)
    names = [name for name, _ in similar.named_parameters()]
    assert not any(name.endswith((".query", ".key")) for name in names)
    attention = next(s for s in similar.stages if hasattr(s, "head_weights"))
    w = attention.head_weights()
    d, dh = w["query"].shape[1], w["query"].shape[2]
    # head l sees its own dh coordinates, scaled to ||A_l|| = 1
    expected = torch.eye(d)[:, :dh]
    torch.testing.assert_close(w["query"][0], expected)
    with pytest.raises(LofastError):
        with_options(model, query_key="learned")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_trains_a_step_and_certifies(name, one_thread):
    """Smoke test: each preset builds, takes one certified-loss step with finite gradients, passes
    the certifier's stage checks, and the exact certifier walks all the stages of the preset cut
    to two blocks (deeper blocks repeat the second's stages, and the exact per-block proofs of
    an untrained model take a second or more each; paper-w384, the stages of paper-d3 at three
    times the width, and lofast-p4, those of lofast-s at 65 tokens (certified in
    test_certify.py's "auto" test), only to the checks)."""
    from lofast.bounds.spectral import Guarantee
    from lofast.certification.certificate import Certifier, automatic_guarantee
    from lofast.training.bound import TrainingBound

    model = create_model(preset(name), seed=0)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    logits, radius = TrainingBound(generator=torch.Generator().manual_seed(0))(model, x, 0.05)
    assert logits.shape == (2, 10) and radius.shape == (2,) and (radius > 0).all()
    (radius.sum() + logits.logsumexp(dim=1).sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    Certifier(model)  # its stage checks
    if name in ("paper-w384", "lofast-p4"):
        return
    two_blocks = create_model(preset(name, depth=min(2, model.config.depth)), seed=0)
    certificate = Certifier(two_blocks).certify(x[:1], two_blocks(x[:1]).argmax(dim=1))
    assert len(certificate.steps) == len(two_blocks.stages) - 1
    assert certificate.guarantee is Guarantee(automatic_guarantee(two_blocks)[0])
    assert (certificate.radius() > 0).all()


def test_value_norm_and_live_blocks_fix_the_last_blocks_attention():
    """value_norm fixes every head's ||Wv_l Wo_l|| (as score_norm fixes ||Wq_l Wk_l^T||), and
    live_blocks confines both, and identity query-key weights, to the last blocks."""
    config = preset("tiny", depth=3, score_norm=4.0, value_norm=0.2, query_key="identity",
                    live_blocks=1)
    model = create_model(config, seed=0).double().eval()  # eval: exact norms
    attention = [spec for spec in model.structure() if type(spec).__name__ == "AttentionSpec"]
    for i, spec in enumerate(attention):
        values = torch.linalg.matrix_norm(spec.value @ spec.output, ord=2)
        scores = torch.linalg.matrix_norm(spec.query @ spec.key.mT, ord=2)
        if i < 2:  # learned and capped: below the caps, not fixed
            assert (values <= 0.25 + 1e-9).all() and (scores <= 1 + 1e-9).all()
        else:
            torch.testing.assert_close(values, torch.full_like(values, 0.2))
            torch.testing.assert_close(scores, torch.full_like(scores, 4.0))
    assert config.parameter_count() == sum(p.numel() for p in model.parameters())
    with pytest.raises(LofastError, match="live_blocks"):
        preset("tiny", live_blocks=3)


def test_identity_value_output_and_live_first_fix_the_first_blocks_attention():
    """value_output=identity makes every head's B_l = Wv_l Wo_l the scaled projection onto the
    coordinates it owns (learned Wv, Wo dropped); live_first puts the live options in the first
    blocks; the certifier and the attention report take such a model as it is."""
    from lofast.certification.attention_report import attention_report
    from lofast.certification.certificate import Certifier

    config = preset("tiny", depth=3, heads=2, score_norm=8.0, value_norm=0.2,
                    query_key="identity", value_output="identity", live_blocks=1,
                    live_first=True, position_bias=True)
    model = create_model(config, seed=0).double().eval()
    attention = [s for s in model.stages if hasattr(s, "head_weights")]
    names = [name for name, _ in attention[0].named_parameters()]
    assert names == ["position_bias"]  # no learned query, key, value or output weights
    assert all(len(list(a.named_parameters())) == 5 for a in attention[1:])
    d, heads = config.width, config.heads
    own = torch.eye(d, dtype=torch.float64).reshape(d, heads, d // heads).permute(1, 0, 2)
    for i, block in enumerate(attention):
        w = block.head_weights()
        values = w["value"] @ w["output"]  # (h, d, d)
        if i == 0:  # 0.2 times the projection onto head l's coordinates
            torch.testing.assert_close(values, 0.2 * own @ own.mT)
            torch.testing.assert_close(torch.linalg.matrix_norm(w["query"] @ w["key"].mT, ord=2),
                                       torch.full((heads,), 8.0, dtype=torch.float64))
        else:
            assert (torch.linalg.matrix_norm(values, ord=2) <= 0.25 + 1e-9).all()
    assert config.parameter_count() == sum(p.numel() for p in model.parameters())
    assert json.loads(config.to_json())["value_output"] == "identity"
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    report = attention_report(model, x, model(x).argmax(dim=1))
    assert report.heads[0].tv_mean > 1e-3 and report.heads[-1].tv_mean < report.heads[0].tv_mean
    assert (Certifier(model).certify(x[:2], model(x[:2]).argmax(dim=1)).radius() > 0).all()
    specs = [s for s in model.structure() if hasattr(s, "coordinate_values")]
    assert specs[0].coordinate_values is not None  # zeta in closed form (bounds.coordinate_jacobian)
    assert all(spec.coordinate_values is None for spec in specs[1:])
    with pytest.raises(LofastError, match="live_first must be true or false"):
        preset("tiny", live_first="yes")
    with pytest.raises(LofastError, match="value_output must be one of"):
        preset("tiny", value_output="zero")


def test_option_kinds_are_enums_read_and_written_as_their_names():
    from lofast.certification.certificate import CertifySettings
    from lofast.config import Bound, Loss, ModelConfig, Pooling, TrainConfig, Weights, plain_dict
    from lofast.errors import CertificationError

    config = preset("tiny", pool="cls", query_key="identity", score_norm=2.0)
    assert config.pool is Pooling.CLASS_TOKEN and config.query_key is Weights.IDENTITY
    written = json.loads(config.to_json())
    assert written["pool"] == "cls" and type(written["pool"]) is str
    assert ModelConfig.from_dict(written) == config
    with pytest.raises(LofastError, match="pool must be one of 'mean', 'cls', not 'max'"):
        preset("tiny", pool="max")
    train = TrainConfig(loss="certified", train_eps=0.1, schedule="constant")
    assert train.loss is Loss.CERTIFIED
    assert all(type(v) is not Loss for v in plain_dict(train).values())  # the saved state
    assert plain_dict(train)["loss"] == "certified"
    with pytest.raises(LofastError, match="loss must be one of 'ce', 'margin', 'certified'"):
        TrainConfig(loss="hinge")
    assert CertifySettings(bound="lofast-tight").bound is Bound.LOFAST_TIGHT
    with pytest.raises(CertificationError, match="bound must be one of"):
        CertifySettings(bound="tight")


def test_training_caps_are_estimated_and_eval_caps_exact():
    """In training mode a capped weight's norm comes from matrix products (no SVD): within a
    small relative error of the cap, from below for the norm, so the capped weight may exceed
    the cap by that error; in eval mode (certification) the cap is exact."""
    from lofast.models.layers import spectral_cap

    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    spectrum = torch.cat([torch.full((6,), 3.0), torch.linspace(2.99, 0.1, 42)])  # flat top
    weight = (u[:, :48] * spectrum) @ v.T
    weight.requires_grad_()
    exact = torch.linalg.matrix_norm(spectral_cap(weight, 1.0), ord=2)
    estimated = torch.linalg.matrix_norm(spectral_cap(weight, 1.0, exact=False), ord=2)
    assert exact.item() == pytest.approx(1.0, rel=1e-12)
    assert 1.0 <= estimated.item() <= 1.002
    spectral_cap(weight, 1.0, exact=False).sum().backward()  # differentiable
    assert torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0
    model = create_model(preset("tiny"), seed=0)
    embed = model.stages[0]
    with torch.no_grad():
        embed.weight.mul_(3.0)
    for training, rel in ((False, 1e-6), (True, 2e-3)):
        model.train(training)
        norm = torch.linalg.matrix_norm(embed.effective_weight().detach(), ord=2).item()
        assert norm == pytest.approx(embed.cap, rel=rel)


def test_evaluate_is_the_accuracy_of_the_exactly_capped_model():
    """``train.evaluate`` (exact caps held once, batches of 500) gives the accuracy of the
    model's own eval-mode forward pass, here on 1,100 images (three batches, the last short);
    the model is left in eval mode with nothing held."""
    import numpy as np

    from lofast.training.loop import evaluate

    model = create_model(preset("tiny", num_classes=4), seed=0).train()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (1100, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 4, 1100)
    accuracy = evaluate(model, images, labels, torch.device("cpu"))
    assert not model.training and all(getattr(s, "held", None) is None for s in model.stages)
    x = torch.as_tensor(images).permute(0, 3, 1, 2).float() / 255
    with torch.no_grad():
        expected = (model(x).argmax(dim=1).numpy() == labels).mean()
    assert accuracy == pytest.approx(expected, abs=1e-12) and 0 < accuracy < 1


def test_held_training_weights_equal_each_stages_own():
    """In training mode a held model estimates every capped weight of every stage together
    (one batched call per weight shape): each stage's effective weights are the ones it
    computes alone, and gradients reach every capped weight through the held ones."""
    model = create_model(preset("tiny", depth=3), seed=0).double().train()
    stages = [s for s in model.stages if hasattr(s, "capped_weights")]
    with torch.no_grad():  # distinct norms (orthogonal initial weights all have norm 1)
        for k, (w, _) in enumerate(w for s in stages for w in s.capped_weights().values()):
            w.mul_(0.3 + 0.25 * k)
    alone = [s.effective_weight() if hasattr(s, "effective_weight") else s.effective_weights()
             for s in stages]
    with model.reusing_effective_weights():
        held = [s.held for s in stages]
        assert all(h is not None for h in held)
        total = 0.0
        for mine, theirs in zip(held, alone):
            pairs = [(mine, theirs)] if torch.is_tensor(mine) else \
                [(mine[k], theirs[k]) for k in theirs]
            for a, b in pairs:
                assert torch.allclose(a, b, rtol=1e-12, atol=0.0)
                total = total + a.sum()
        total.backward()
    capped = [w for s in stages for w, _ in s.capped_weights().values()]
    assert len(capped) == 1 + 4 * 3 and all(w.grad is not None and w.grad.abs().sum() > 0
                                            for w in capped)


def test_held_sll_rescaling_is_each_layers_own_until_released():
    """A held model's SLL layers reuse t (their k x k Gram matrices) for the rest of a step,
    with gradients through it, and compute it afresh once released."""
    model = create_model(preset("tiny", depth=2), seed=0).double().train()
    layers = [s for s in model.stages if isinstance(s, SLL)]
    own = [s.rescaling() for s in layers]
    with model.reusing_effective_weights():
        with torch.no_grad():
            layers[0].log_q[0] += 1.0  # held: t does not follow until released
        for layer, t in zip(layers, own):
            assert layer.rescaling() is layer.held_rescaling and torch.equal(layer.rescaling(), t)
        model(torch.rand(2, 3, 32, 32, dtype=torch.float64)).sum().backward()
    assert len(layers) == 2 and all(s.held_rescaling is None for s in layers)
    assert all(s.log_q.grad is not None and s.log_q.grad.abs().sum() > 0 for s in layers)
    assert not torch.allclose(layers[0].rescaling(), own[0])


def test_batched_training_caps_match_one_at_a_time():
    """spectral_caps estimates a block's same-shaped weights in one batched call: each result
    is the weight capped with its own cap (a weight without a cap comes back unchanged), as
    spectral_cap gives it alone, and gradients reach every weight."""
    from lofast.models.layers import spectral_cap, spectral_caps

    g = torch.Generator().manual_seed(3)
    weights = {name: (torch.randn(32, 32, generator=g, dtype=torch.float64) * scale)
               .requires_grad_() for name, scale in (("a", 0.02), ("b", 1.0), ("c", 5.0),
                                                     ("d", 2.0))}
    caps = {"a": 1.0, "b": 0.5, "c": 0.5, "d": None}
    batched = spectral_caps(weights, caps, exact=False)
    for name, cap in caps.items():
        alone = spectral_cap(weights[name], cap, exact=False)
        assert torch.allclose(batched[name], alone, rtol=1e-12, atol=0.0), name
    assert batched["d"] is weights["d"]
    assert torch.equal(batched["a"], weights["a"])  # under its cap: untouched
    for name in "bc":
        norm = torch.linalg.matrix_norm(batched[name].detach(), ord=2).item()
        assert norm == pytest.approx(caps[name], rel=2e-3)
    sum(w.sum() for w in batched.values()).backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in weights.values())
    exact = spectral_caps(weights, caps, exact=True)
    assert torch.linalg.matrix_norm(exact["c"].detach(), ord=2).item() == pytest.approx(0.5,
                                                                                      rel=1e-12)


def test_augment_crops_and_flips_from_its_generator():
    """Every augmented image is one of the 81 crops of the 4-pixel zero-padded image, flipped
    or not, chosen by the generator (the same seed, the same batch), all of them in use."""
    import torch.nn.functional as F

    from lofast.training.loop import augment

    images = torch.rand(64, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    out = augment(images, torch.Generator().manual_seed(1))
    assert out.shape == images.shape
    assert torch.equal(out, augment(images, torch.Generator().manual_seed(1)))
    padded = F.pad(images, (4, 4, 4, 4))
    crops = torch.stack([padded[:, :, dy:dy + 8, dx:dx + 8]
                         for dy in range(9) for dx in range(9)], dim=1)  # (B, 81, C, H, W)
    candidates = torch.cat([crops, crops.flip(-1)], dim=1)  # (B, 162, C, H, W)
    matches = (candidates == out[:, None]).flatten(2).all(dim=2)  # (B, 162)
    assert matches.any(dim=1).all()
    chosen = matches.float().argmax(dim=1)
    assert (chosen >= 81).any() and (chosen < 81).any()  # flipped and not
    assert len(set((chosen % 81).tolist())) > 20  # many offsets


def test_an_eval_model_computes_its_exact_caps_once_until_a_weight_changes(monkeypatch):
    """Inference (eval mode, no gradient recorded for the weights) pays the SVDs of the exact
    caps on the first forward pass only; changing a weight in place, or moving the model,
    computes them again; the outputs equal those of the caps computed afresh."""
    from lofast.models import layers

    model = create_model(preset("tiny", num_classes=4), seed=0).eval()
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fresh = model(x)  # before counting
    exact = []
    original = layers.spectral_norm
    monkeypatch.setattr(layers, "spectral_norm", lambda w, exact_=False, **k: (
        exact.append(k.get("exact", exact_)), original(w, k.get("exact", exact_)))[1])
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), fresh)
        assert exact == []  # kept since the forward pass above
        model.stages[2].weights["value"].add_(0.1)  # in place: a new direction
        changed = model(x)
        assert exact and all(exact) and not torch.equal(changed, fresh)
        count = len(exact)
        model(x)
        assert len(exact) == count
        model.double()
        model(x.double())
        assert len(exact) > count
    assert "capped" in model.stages[0]._kept_values
    model.train()
    with torch.no_grad():
        model(x.double())  # training mode: estimated caps, never the kept exact ones
    assert not all(exact[count:])


def _counting_rescalings(monkeypatch):
    """A tiny eval model, a batch for it, and the list of SLL layers whose t is computed, one
    entry per computation."""
    from lofast.models import layers

    model = create_model(preset("tiny", num_classes=4), seed=0).eval()
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    calls = []
    original = layers.SLL._rescaling_now
    monkeypatch.setattr(layers.SLL, "_rescaling_now",
                        lambda self: calls.append(self) or original(self))
    return model, x, calls


def test_an_eval_model_keeps_its_sll_rescaling_until_a_weight_changes(monkeypatch):
    """The SLL layers' t (a k x k Gram matrix of W each) is kept like the caps: computed on the
    first eval-mode pass without gradients, again after a weight changes, never in training."""
    from lofast.models import layers

    model, x, calls = _counting_rescalings(monkeypatch)
    sll = [s for s in model.stages if isinstance(s, layers.SLL)]
    with torch.no_grad():
        first = model(x)
        assert len(calls) == len(sll)
        assert torch.equal(model(x), first) and len(calls) == len(sll)
        sll[0].weight[:, 0].mul_(0.5)  # in place, one unit's weights: t changes with it
        assert not torch.equal(model(x), first) and len(calls) == len(sll) + 1
    model(x).sum().backward()  # the kept t in the forward pass, t again for its gradient
    assert len(calls) == 2 * len(sll) + 1 and sll[0].weight.grad is not None
    model.train()
    with torch.no_grad():
        model(x)
    assert len(calls) == 3 * len(sll) + 1


def test_a_change_through_data_is_taken_after_eval(monkeypatch):
    """PyTorch counts no in-place change made through ``.data``; the kept caps and SLL
    rescaling would then go stale (an SLL with a grown weight and its old t is not
    1-Lipschitz), so ``eval()`` compares the tensors with the copies the kept values were made
    from: after a change the outputs are again those of a fresh model with the new weights,
    and without one ``eval()`` computes nothing again."""
    model, x, calls = _counting_rescalings(monkeypatch)
    with torch.no_grad():
        before = model(x)
        count = len(calls)
        model.eval()
        assert torch.equal(model(x), before) and len(calls) == count  # unchanged: kept
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.data.mul_(2.0)
        model.eval()
        after = model(x)
        assert len(calls) == 2 * count
    fresh = create_model(preset("tiny", num_classes=4), seed=0).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = fresh(x)
    assert not torch.allclose(before, expected)
    assert torch.equal(after, expected)


def _kept_values_bypassed(monkeypatch):
    """Every derived quantity computed afresh, in the graph, as in a model that keeps none."""
    from lofast.models import layers

    monkeypatch.setattr(layers.KeepsWhileFrozen, "_kept", lambda self, name, compute: compute())


def test_gradients_through_kept_values_equal_those_of_a_fresh_graph(monkeypatch):
    """An eval-mode model with gradients recorded reuses its kept caps and rescalings in the
    forward pass; the input's and every parameter's gradient (and a second derivative) equal
    those of the quantities computed afresh in the graph, in float64."""
    model = create_model(preset("tiny", num_classes=4, position_bias=True), seed=0)
    model = model.double().eval()
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0),
                   dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [p for p in model.parameters()]

    def gradients():
        with torch.no_grad():
            model(x)  # keeps every derived quantity (a no-op where nothing is kept)
        loss = (model(x) * weights).sum()
        grads = torch.autograd.grad(loss, [x, *params], create_graph=True)
        second, = torch.autograd.grad(sum(g.square().sum() for g in grads[1:]), x)
        return [g.detach() for g in grads], second

    kept, kept_second = gradients()
    with monkeypatch.context() as patch:
        _kept_values_bypassed(patch)
        fresh, fresh_second = gradients()
    assert len(kept) == len(params) + 1
    for a, b in zip(kept, fresh):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    assert torch.allclose(kept_second, fresh_second, rtol=1e-9, atol=1e-12)
    assert kept_second.abs().max() > 0


def test_an_input_gradient_of_an_eval_model_pays_no_svd(monkeypatch):
    """An attack's gradient with respect to the input (parameters requiring gradients, as
    loaded) reuses the kept caps and rescalings, held or not: no SVD and no Gram matrix after
    the first pass; a backward pass into the weights computes them once more, for their gradients; an
    in-place change of a weight between the forward and the backward pass fails loudly."""
    from lofast.models import layers

    model = create_model(preset("tiny", num_classes=4), seed=0).eval()
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    model(x)  # keeps them
    calls = []
    original_norm, original_rescaling = layers.spectral_norm, layers.SLL._rescaling_now
    monkeypatch.setattr(layers, "spectral_norm", lambda *a, **k: (
        calls.append("svd"), original_norm(*a, **k))[1])
    monkeypatch.setattr(layers.SLL, "_rescaling_now",
                        lambda self: calls.append("gram") or original_rescaling(self))
    for _ in range(3):
        grad, = torch.autograd.grad(model(x).max(dim=1).values.sum(), x)
        assert grad.abs().max() > 0
    with model.reusing_effective_weights():  # as the attacks hold them: the kept ones
        for _ in range(2):
            held, = torch.autograd.grad(model(x).max(dim=1).values.sum(), x)
    assert torch.equal(held, grad)
    assert calls == []
    model(x).sum().backward()
    assert "svd" in calls and "gram" in calls
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    out = model(x).sum()
    with torch.no_grad():
        model.stages[0].weight.mul_(0.5)  # the patch embedding's raw weight, under a cap
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_torch_func_transforms_take_an_eval_model_with_kept_values():
    """torch.func's jacrev and vmap over a loaded (eval-mode) model, whose caps and rescalings
    are kept: the input Jacobian equals autograd's row by row, vmap the batched forward pass."""
    model = create_model(preset("tiny", num_classes=4), seed=0).double().eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model(x)  # keeps them
    jacobian = torch.func.jacrev(lambda z: model(z[None])[0])(x[0])
    single = x[:1].clone().requires_grad_(True)
    rows = torch.stack([torch.autograd.grad(model(single)[0, c], single)[0][0]
                        for c in range(4)])
    assert torch.allclose(jacobian, rows, rtol=1e-10, atol=1e-13)
    assert torch.allclose(torch.func.vmap(lambda z: model(z[None])[0])(x), model(x))


def test_a_frozen_copy_keeps_its_held_weights_through_a_reusing_block(monkeypatch):
    """An attack's ``reusing_effective_weights`` inside a ``frozen`` copy reuses the
    copy's held weights: no SVD, and nothing released when the block ends."""
    from lofast.models import layers

    model = create_model(preset("tiny", num_classes=4), seed=0).eval()
    frozen = model.frozen("cpu")
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    held = [stage.held for stage in frozen.stages if isinstance(stage, layers.HoldsCappedWeights)]
    assert held and all(h is not None for h in held)
    calls = []
    monkeypatch.setattr(layers, "spectral_norm", lambda *a, **k: calls.append(a))
    with frozen.reusing_effective_weights():
        frozen(x).sum()
    assert calls == []
    after = [stage.held for stage in frozen.stages if isinstance(stage, layers.HoldsCappedWeights)]
    assert all(a is b for a, b in zip(after, held))
