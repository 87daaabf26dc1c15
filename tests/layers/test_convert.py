"""``qkv convert`` (issue 54): nanoGPT's ckpt.pt in and out, and transformers' GPT-2 out.

nanoGPT is not installed here, so its side is written in this file from its published
``model.py`` and ``sample.py``: :class:`NanoGPT` has nanoGPT's modules, names and shapes
(``transformer.wte/wpe/h.{i}.ln_1/attn.c_attn/attn.c_proj/ln_2/mlp.c_fc/mlp.c_proj/ln_f``,
``nn.Linear`` weights ``(out, in)``, ``lm_head`` tied to ``wte``, ``nn.GELU()``, LayerNorm eps
1e-5 with an optional bias), :func:`nanogpt_load` loads a ckpt.pt exactly as ``sample.py``
does (strip ``_orig_mod.``, ``GPTConfig(**model_args)``, ``load_state_dict`` strict, meta.pkl
from ``data/<dataset>/``), and :func:`nanogpt_optimizer` makes ``configure_optimizers``' two
AdamW groups, which ``train.py --init_from=resume`` loads the saved state into.
"""
import json
import math
import os
import pickle
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="qkv convert writes safetensors: pip install -e '.[models]'")

from qkv.cli import main  # noqa: E402
from qkv.models import GPT, GPTConfig  # noqa: E402
from qkv.io.checkpoint import CheckpointError  # noqa: E402
from qkv.io.nanogpt import from_nanogpt, nanogpt_refusals, to_nanogpt  # noqa: E402

CHARS = "".join(sorted("\n !,.:;?abcdefghijklmnopqrstuvwxyzT"))  # meta.pkl's characters: sorted, as prepare.py
TINY = ["--block-size", "16", "--batch-size", "4", "--n-layer", "2", "--n-head", "2", "--n-embd", "16",
        "--eval-iters", "2", "--eval-interval", "3", "--warmup", "1", "--steps", "3", "--no-progress"]


# --- the table alone (NumPy): fast ---------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_table_round_trip_and_layout(bias):
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=bias, activation="gelu")
    model = GPT(cfg)
    state = to_nanogpt(model.params, cfg)
    assert state["transformer.h.1.attn.c_attn.weight"].shape == (24, 8)            # nn.Linear: (out, in)
    assert np.array_equal(state["transformer.h.0.attn.c_attn.weight"][8:16], model.params["transformer.h.0.attn.W_K"].T)
    assert ("transformer.h.0.mlp.c_fc.bias" in state) == bias and "lm_head.weight" not in state
    state["lm_head.weight"] = state["transformer.wte.weight"]
    back = from_nanogpt(state, cfg, "ckpt.pt")
    assert set(back) == set(model.params)
    assert all(np.array_equal(back[k], v) for k, v in model.params.items())


def test_table_refuses_by_name():
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, activation="gelu")
    state = to_nanogpt(GPT(cfg).params, cfg)
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\).*transformer.ln_f.weight"):
        from_nanogpt({k: v for k, v in state.items() if k != "transformer.ln_f.weight"}, cfg, "ckpt.pt")
    with pytest.raises(CheckpointError, match="must have shape \\(24, 8\\)"):
        from_nanogpt({**state, "transformer.h.0.attn.c_attn.weight": np.zeros((8, 24))}, cfg, "ckpt.pt")
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        from_nanogpt({**state, "lm_head.weight": state["transformer.wte.weight"] + 1}, cfg, "ckpt.pt")
    said = nanogpt_refusals(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8, layers="griffin",
                                      positions="rope"))
    assert any("hybrid" in s for s in said) and any("rope" in s for s in said) and any("gelu_tanh" in s for s in said)


# --- nanoGPT's side, from its published model.py and sample.py --------------------------------------

def _nanogpt():
    torch = pytest.importorskip("torch", reason="nanoGPT's side is PyTorch: pip install -e '.[torch]'")
    nn, F = torch.nn, torch.nn.functional

    @dataclass
    class GPTConfig_:
        block_size: int = 1024
        vocab_size: int = 50304
        n_layer: int = 12
        n_head: int = 12
        n_embd: int = 768
        dropout: float = 0.0
        bias: bool = True

    class LayerNorm(nn.Module):
        def __init__(self, ndim, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))
            self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
            self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
            self.n_head, self.n_embd = c.n_head, c.n_embd

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class MLP(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.ln_1, self.attn = LayerNorm(c.n_embd, c.bias), CausalSelfAttention(c)
            self.ln_2, self.mlp = LayerNorm(c.n_embd, c.bias), MLP(c)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class NanoGPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.config = c
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
                drop=nn.Dropout(c.dropout), h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
                ln_f=LayerNorm(c.n_embd, c.bias)))
            self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx):
            t = idx.size(1)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t)))
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(self.transformer.ln_f(x))     # (B, T, V): every position, for the test

        def configure_optimizers(self, weight_decay, learning_rate, betas):
            params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
            groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                      {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    return torch, GPTConfig_, NanoGPT


def nanogpt_load(path):
    """nanoGPT's sample.py: the checkpoint, its model (strict), and its encode/decode from meta.pkl."""
    torch, Config, NanoGPT = _nanogpt()
    checkpoint = torch.load(path, map_location="cpu")
    model = NanoGPT(Config(**checkpoint["model_args"]))
    state_dict = checkpoint["model"]
    for k in list(state_dict):
        if k.startswith("_orig_mod."):
            state_dict[k[len("_orig_mod."):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    model.eval()
    meta_path = os.path.join("data", checkpoint["config"]["dataset"], "meta.pkl")
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    stoi, itos = meta["stoi"], meta["itos"]
    return checkpoint, model, (lambda s: [stoi[c] for c in s]), (lambda ids: "".join(itos[i] for i in ids))


def nanogpt_greedy(model, ids, n):
    """nanoGPT's generate with the argmax in place of the draw (crop to block_size, last logits)."""
    torch = _nanogpt()[0]
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -model.config.block_size:])[:, -1, :]
            idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx[0].tolist()


def _sample(capsys, folder, n, prompt="\n"):
    capsys.readouterr()
    assert main(["sample", str(folder), "--temperature", "0", "--tokens", str(n), "--prompt", prompt]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_checkpoint_sampled_by_qkv(tmp_path, monkeypatch, capsys, bias):
    """train.py's ckpt.pt (compiled keys, a tensor best_val_loss) -> qkv convert -> qkv sample: nanoGPT's greedy text."""
    torch, Config, NanoGPT = _nanogpt()
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    args = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, bias=bias, vocab_size=len(CHARS), dropout=0.0)
    model = NanoGPT(Config(**args))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)       # far from init's near-uniform logits: no argmax near a tie
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99))
    (tmp_path / "data" / "chars").mkdir(parents=True)
    meta = {"vocab_size": len(CHARS), "itos": dict(enumerate(CHARS)), "stoi": {c: i for i, c in enumerate(CHARS)}}
    (tmp_path / "data" / "chars" / "meta.pkl").write_bytes(pickle.dumps(meta))
    state = {"_orig_mod." + k: v for k, v in model.state_dict().items()}       # torch.compile's keys
    ckpt = {"model": state, "optimizer": opt.state_dict(), "model_args": args, "iter_num": 7,
            "best_val_loss": torch.tensor(2.5), "config": {"dataset": "chars", "max_iters": 7}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    capsys.readouterr()
    assert main(["convert", "ckpt.pt", "out-qkv"]) == 0
    assert "data/chars/meta.pkl" in capsys.readouterr().out
    ids = [CHARS.index(c) for c in "to be"]
    want = "".join(CHARS[i] for i in nanogpt_greedy(model, ids, 40))
    assert _sample(capsys, tmp_path / "out-qkv", 40, "to be") == want + "\n"
    saved = json.loads((tmp_path / "out-qkv" / "config.json").read_text())["extra"]["nanogpt"]
    assert saved["iter_num"] == 7 and saved["best_val_loss"] == 2.5


@pytest.mark.slow
def test_qkv_run_sampled_and_resumed_by_nanogpt(tmp_path, monkeypatch, capsys):
    """qkv train gpt -> qkv convert DIR ckpt.pt -> nanoGPT's sample.py (strict load, meta.pkl from
    data/<dataset>/) gives qkv sample's greedy text, and train.py's resume loads the optimizer."""
    torch = _nanogpt()[0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "play.txt").write_text("to be or not to be, that is the question: whether tis nobler\n" * 30)
    assert main(["train", "gpt", "--data", "play.txt", "--out", "run", "--activation", "gelu", "--bias",
                 "--lr", "3e-2", *TINY]) == 0
    assert main(["convert", "run", "nano/ckpt.pt"]) == 0
    (tmp_path / "data" / "play").mkdir(parents=True)
    os.replace(tmp_path / "nano" / "meta.pkl", tmp_path / "data" / "play" / "meta.pkl")   # where sample.py looks
    checkpoint, model, encode, decode = nanogpt_load(tmp_path / "nano" / "ckpt.pt")
    assert checkpoint["iter_num"] == 3 and checkpoint["config"]["max_iters"] == 3
    assert _sample(capsys, tmp_path / "run", 30) == decode(nanogpt_greedy(model, encode("\n"), 30)) + "\n"
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99))
    opt.load_state_dict(checkpoint["optimizer"])                     # train.py --init_from=resume
    from qkv.io.runfiles import load_state

    adam = load_state(tmp_path / "run" / "optim.safetensors")
    w = model.transformer.h[1].attn.c_attn.weight
    assert np.allclose(opt.state[w]["exp_avg"][16:32].numpy(), adam["m/transformer.h.1.attn.W_K"].T)
    assert float(opt.state[w]["step"]) == 3
    x = torch.tensor([encode("to be or not")])
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[0, 1:])
    loss.backward()
    opt.step()                                                       # a step of the resumed run
    assert math.isfinite(float(loss.detach())) and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_convert_refuses_what_nanogpt_cannot_hold(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "play.txt").write_text("to be or not to be\n" * 40)
    assert main(["train", "gpt", "--data", "play.txt", "--out", "run", "--activation", "gelu_tanh", *TINY]) == 0
    capsys.readouterr()
    assert main(["convert", "run", "nano/ckpt.pt"]) == 2
    err = capsys.readouterr().err
    assert "activation 'gelu_tanh'" in err and "--activation gelu" in err and not (tmp_path / "nano" / "ckpt.pt").exists()
    assert main(["convert", "run", "somewhere"]) == 2
    assert "ending in .pt" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--activation", "gelu_tanh"], ["--activation", "gelu", "--bias"]])
def test_gpt2_export_loads_in_transformers_with_equal_logits(tmp_path, monkeypatch, capsys, flags):
    """qkv's default run (no biases, exact GELU), a GPT-2-like and a nanoGPT-like one, as GPT2LMHeadModel."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from qkv.models import load_gpt, load_gpt2

    monkeypatch.chdir(tmp_path)
    (tmp_path / "play.txt").write_text("to be or not to be\n" * 40)
    assert main(["train", "gpt", "--data", "play.txt", "--out", "run", "--lr", "3e-2", *TINY, *flags]) == 0
    assert main(["convert", "run", "hf", "--to", "hf"]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_gpt(tmp_path / "run")
    idx = np.random.default_rng(0).integers(0, ours.config.vocab_size, (2, 16))
    with torch.no_grad():
        want = hf(torch.from_numpy(idx)).logits.numpy()
    assert np.abs(ours.eval().forward(idx) - want).max() < 1e-4
    assert np.abs(load_gpt2(tmp_path / "hf").forward(idx) - want).max() < 1e-4


@pytest.mark.slow
def test_sample_takes_a_gpt2_folder_as_init_from_does(tmp_path, monkeypatch, capsys):
    """A BPE run exported with --to hf (its tokenizer.json beside) samples as the run does; a
    name that is neither a run, a folder nor a cached hub id says so."""
    tk = pytest.importorskip("tokenizers", reason="BPE needs tokenizers: pip install -e '.[models]'")
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    text = "to be or not to be, that is the question: whether tis nobler in the mind\n" * 30
    (tmp_path / "play.txt").write_text(text)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator([text], tk.trainers.BpeTrainer(vocab_size=280,
                                                           initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert main(["train", "gpt", "--data", "play.txt", "--tokenizer", "tokenizer.json", "--out", "run",
                 "--lr", "3e-2", *TINY]) == 0
    assert main(["convert", "run", "hf", "--to", "hf"]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert _sample(capsys, tmp_path / "hf", 12, "to be") == _sample(capsys, tmp_path / "run", 12, "to be")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-cache"))
    assert main(["sample", "someone/no-such-model", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "not in the Hugging Face cache" in err and "--init-from" not in err


@pytest.mark.slow
def test_the_default_run_goes_to_nanogpt_and_transformers_and_comes_back(tmp_path, monkeypatch, capsys):
    """The README's quick try, small: a default qkv train gpt run (no --activation), converted to
    nanoGPT's ckpt.pt and to a transformers folder (with its character tokenizer), sampled greedily
    by nanoGPT's model, by transformers (AutoTokenizer + GPT2LMHeadModel) and by qkv sample from
    each: one text; and nanoGPT's ckpt.pt converted back samples it too."""
    torch = _nanogpt()[0]
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "play.txt").write_text("to be or not to be, that is the question: whether tis nobler\n" * 30)
    assert main(["train", "gpt", "--data", "play.txt", "--out", "out-gpt", "--lr", "3e-2", *TINY]) == 0
    assert json.loads((tmp_path / "out-gpt" / "config.json").read_text())["config"]["activation"] == "gelu"
    want = _sample(capsys, tmp_path / "out-gpt", 30, "to be")
    assert main(["convert", "out-gpt", "nano/ckpt.pt"]) == 0
    assert main(["convert", "out-gpt", "out-hf", "--to", "hf"]) == 0
    (tmp_path / "data" / "play").mkdir(parents=True)
    os.replace(tmp_path / "nano" / "meta.pkl", tmp_path / "data" / "play" / "meta.pkl")   # where sample.py looks
    _, model, encode, decode = nanogpt_load(tmp_path / "nano" / "ckpt.pt")
    assert decode(nanogpt_greedy(model, encode("to be"), 30)) + "\n" == want
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out-hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out-hf").eval()
    ids = torch.tensor([tok("to be")["input_ids"]])
    with torch.no_grad():
        for _ in range(30):
            ids = torch.cat([ids, hf(ids[:, -16:]).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert tok.decode(ids[0].tolist()) + "\n" == want
    assert _sample(capsys, tmp_path / "out-hf", 30, "to be") == want
    assert main(["convert", "nano/ckpt.pt", "back"]) == 0
    assert _sample(capsys, tmp_path / "back", 30, "to be") == want
