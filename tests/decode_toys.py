"""Toys shared by the decoder tests: tiny random-init Llama targets with a stub tokenizer, drafters
that are right only some of the time, wrong acceptance rules, and a chi-square check.

Targets run in float64 so a batched verification forward never flips an argmax that a one-token
forward would pick: greedy outputs can then be compared token for token.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.decode.accept import accepted_prefix
from specdistill.drafters.base import ChainProposal, Drafter, TreeProposal
from specdistill.drafters.parts.sampling import sample, warp
from specdistill.drafters.parts.tree import draw_children
from specdistill.target.model import Target

V = 64  # vocabulary of the default tiny target


class StubTokenizer:
    """Token i decodes to two characters, so stop strings can start inside a token."""

    def __init__(self, eos=None):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + i // 8) + chr(97 + i % 8) for i in ids)


def make_target(vocab=V, seed=0, eos=None, init=0.02, max_pos=512) -> Target:
    """A 2-layer Llama (hidden 32, 4 heads, 2 KV heads), random init, float64."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      initializer_range=init, bos_token_id=None, eos_token_id=eos, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return Target(model, StubTokenizer(eos), "tiny")


def greedy_next(target: Target, tokens: torch.Tensor) -> int:
    """The target's greedy next token after tokens (T,), from a fresh full forward."""
    return int(target.model(tokens[None]).logits[0, -1].argmax())


class NoisyOracle(Drafter):
    """Drafts the target's own greedy continuation, corrupting each token with prob `noise`
    (a corrupted token also changes the rest of the chain, as a real drafter's would).
    Records the (tokens, features) it is shown each round."""

    def __init__(self, target, noise=0.3, seed=0, feature_layers=(), over_propose=0):
        super().__init__(target.vocab_size)
        self.target, self.noise, self.over = target, noise, over_propose
        self.feature_layers = feature_layers
        self.gen = torch.Generator().manual_seed(seed)
        self.states = []

    def reset(self):
        self.states = []

    def _record(self, state):
        feats = None if state.features is None else state.features.clone()
        self.states.append((state.tokens.clone(), feats))

    def _noisy(self, tok):
        if float(torch.rand((), generator=self.gen)) < self.noise:
            tok = (tok + 1 + int(torch.randint(self.vocab_size - 1, (), generator=self.gen)))
        return tok % self.vocab_size

    def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
        self._record(state)
        toks, out = state.tokens, []
        for _ in range(k + self.over):  # over_propose: ignore k, the decoder must cut
            out.append(self._noisy(greedy_next(self.target, toks)))
            toks = torch.cat([toks, torch.tensor(out[-1:])])
        return ChainProposal(tokens=torch.tensor(out, dtype=torch.long))

    def propose_tree(self, state, sampling, generator=None, depth=4, width=3):
        """A tree whose true path (when the noise spares it) sits at a random child index; the
        true child and the first child of each expanded node are expanded further."""
        self._record(state)
        tokens, parents = [], []
        frontier = [(-1, state.tokens, True)]  # (node, its context, on the true path)
        for _ in range(depth):
            nxt = []
            for node, ctx, true in frontier:
                right = greedy_next(self.target, ctx) if true else -1
                hide = float(torch.rand((), generator=self.gen)) < self.noise
                slot = int(torch.randint(width, (), generator=self.gen))
                wrong = [t for t in torch.randperm(self.vocab_size, generator=self.gen).tolist()
                         if t != right]
                for c in range(width):
                    tok = right if (c == slot and true and not hide) else wrong[c]
                    tokens.append(tok)
                    parents.append(node)
                    if c in (0, slot):
                        nxt.append((len(tokens) - 1, torch.cat([ctx, torch.tensor([tok])]),
                                    tok == right))
            frontier = nxt[:2]
        return TreeProposal(torch.tensor(tokens), torch.tensor(parents))


class FixedQ(Drafter):
    """Samples every draft from one fixed distribution with most of its mass on token 0, far from
    the target's, so wrong acceptance rules show a large bias."""

    def __init__(self, vocab):
        super().__init__(vocab)
        self.logits = torch.full((vocab,), -2.0)
        self.logits[0] = 2.5

    def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
        q = warp(self.logits.expand(k, -1), sampling)  # (k, V)
        return ChainProposal(tokens=sample(q, generator), probs=q)


class SampledToyTree(Drafter):
    """A depth-2 tree of `width` children per node drawn from fixed q's far from the target's
    (most mass on token 0 at depth 1, on token 1 at depth 2): "without" replacement, "iid", or
    "fixed" (deterministic candidates 0, 1, .. with probs None)."""

    def __init__(self, vocab, mode, width=2):
        super().__init__(vocab)
        self.mode, self.width = mode, width
        self.logits = torch.full((2, vocab), -2.0)  # (depth, V)
        self.logits[0, 0], self.logits[1, 1] = 2.5, 2.0

    def _children(self, q, generator):
        if self.mode == "without":
            return draw_children(q, self.width, generator)
        if self.mode == "iid":
            return torch.multinomial(q, self.width, True, generator=generator), q.expand(self.width, -1)
        return torch.arange(self.width), q.expand(self.width, -1)

    def propose_tree(self, state, sampling, generator=None):
        tokens, parents, probs = [], [], []
        for node in [-1] + list(range(self.width)):  # the root, then each depth-1 node
            tok, cond = self._children(warp(self.logits[0 if node < 0 else 1], sampling), generator)
            tokens += tok.tolist()
            parents += [node] * len(tok)
            probs.append(cond)
        return TreeProposal(torch.tensor(tokens), torch.tensor(parents),
                            None if self.mode == "fixed" else torch.cat(probs))


def wrong_rule(kind: str):
    """A plausible but wrong acceptance rule with accept_chain's signature (sampling only):
    "resample_from_p": on rejection sample from p instead of norm(max(0, p - q));
    "inverted_ratio": accept with probability min(1, q/p) instead of min(1, p/q);
    "always_accept": trust the drafter (the output then follows q)."""

    def rule(draft, q, logits, sampling, generator=None):
        p = warp(logits, sampling)  # (B, m+1, V)
        B, m = draft.shape
        q = torch.nn.functional.one_hot(draft, p.shape[-1]).to(p.dtype) if q is None else q
        p_d = p[:, :m].gather(-1, draft[..., None]).squeeze(-1)  # (B, m)
        q_d = q.gather(-1, draft[..., None]).squeeze(-1)  # (B, m)
        u = torch.rand(B, m, generator=generator, dtype=p.dtype)
        ok = {"resample_from_p": u * q_d < p_d, "inverted_ratio": u * p_d < q_d,
              "always_accept": torch.ones_like(u, dtype=torch.bool)}[kind]
        n = accepted_prefix(ok)  # (B,)
        rows = torch.arange(B)
        p_n = p[rows, n]  # (B, V)
        if kind == "resample_from_p":
            return n, sample(p_n, generator)
        q_n = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], 1)[rows, n]  # (B, V)
        res = (p_n - q_n).clamp_min(0)
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, p_n)
        return n, sample(res / res.sum(-1, keepdim=True), generator)

    return rule


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of counts against probs (cells expected < 5 pooled) and its 1e-4
    critical value (Wilson-Hilferty approximation; scipy is not a dependency). A count in a cell
    of probability 0 gives an infinite statistic."""
    if bool((counts[probs == 0] > 0).any()):
        return float("inf"), 1.0
    exp = probs.double() * counts.sum()
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = max(len(exp) - 1, 1)
    z = 3.719  # one-sided standard normal quantile for alpha = 1e-4
    crit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return stat, crit


def pair_joint(target: Target, prompt: list[int], sampling) -> torch.Tensor:
    """(V*V,) exact joint of generated tokens 2 and 3 (index t2 * V + t3) after `prompt`:
    sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), with the warped target distributions."""
    from specdistill.drafters.parts.sampling import warp

    Vs, P = target.vocab_size, len(prompt)
    seqs = torch.tensor([prompt + [a, b] for a in range(Vs) for b in range(Vs)])  # (V*V, P+2)
    p = warp(target.model(seqs).logits, sampling)  # (V*V, P+2, V)
    p1, p2 = p[0, P - 1], p[::Vs, P]  # (V,), (V, V) [t1, t2]
    p3 = p[:, P + 1].reshape(Vs, Vs, Vs)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).reshape(-1)  # (V*V,)


def pair_counts(target: Target, drafter, prompt: list[int], sampling, n: int, tree: bool = False):
    """n seeded speculative generations of 4 tokens with k=2 (or a tree, cut to depth 2 by the
    budget): counts of (t2, t3) (V*V,) and of the drafts accepted in the first round (3,)."""
    from specdistill.decode.spec import generate

    Vs = target.vocab_size
    gen = torch.Generator().manual_seed(0)
    c, first_round = torch.zeros(Vs * Vs), torch.zeros(3)
    for _ in range(n):
        res = generate(target, drafter, prompt, max_new_tokens=4, k=2, sampling=sampling,
                       tree=tree, generator=gen)
        c[res.tokens[1] * Vs + res.tokens[2]] += 1
        first_round[res.accepted[0]] += 1
    return c, first_round


def greedy_lossless_accepted(target: Target, drafter, tree: bool, vocab: int = 64) -> int:
    """Asserts greedy speculative output == plain greedy on 4 seeded prompts (k=4, 30 tokens);
    returns the drafts accepted in all, so a test can check acceptance was exercised."""
    from specdistill.decode.spec import generate

    accepted = 0
    for seed in range(4):
        prompt = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(100 + seed))
        plain = generate(target, None, prompt, max_new_tokens=30)
        spec = generate(target, drafter, prompt, max_new_tokens=30, k=4, tree=tree)
        assert spec.tokens.tolist() == plain.tokens.tolist()
        accepted += sum(spec.accepted)
    return accepted


def jsonl_prompt_ids(target, prompts_file) -> dict:
    """id -> the chat-template prompt ids (P,) of every prompt in an eval=jsonl file, as
    `python -m decode` renders them (first turn)."""
    import json
    out = {}
    for line in prompts_file.read_text().splitlines():
        row = json.loads(line)
        out[row["id"]] = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
            return_tensors="pt")["input_ids"][0]
    return out


def teach(tgt: Target, cfg: dict, vocab: int = 64, steps: int = 80, n: int = 32) -> Drafter:
    """The trainable drafter of config cfg trained briefly (forward KL, AdamW 3e-3) on n of the
    target's own greedy answers (28 tokens after 4 random ones), so that decoding accepts drafts:
    a random drafter would be trivially lossless."""
    from specdistill.decode.spec import generate
    from specdistill.drafters.base import TrainBatch, build_drafter
    from specdistill.train.losses import distill_loss

    torch.manual_seed(0)
    d = build_drafter(cfg, tgt)
    prompts = torch.randint(0, vocab, (n, 4), generator=torch.Generator().manual_seed(1))
    ids = torch.stack([generate(tgt, None, p, max_new_tokens=28).tokens for p in prompts])
    ids = torch.cat([prompts, ids], 1)  # (n, 32)
    out = tgt.forward(ids, layers=d.feature_layers)
    ones = torch.ones_like(ids)
    batch = TrainBatch(ids, ones, ones, out.logits.float(), out.features.float())
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = distill_loss(d.forward_train(batch), batch, "forward_kl")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d


def check_sampling_lossless(tgt: Target, drafter, monkeypatch, n: int = 2000, wrong_n: int = 2000,
                            min_round: int = 50) -> None:
    """Tokens 2 and 3 after [1, 2, 3, 4], sampled at T=1 / top-k 6 through one round of 2 drafts:
    their empirical joint matches the exact one from the target's logits (chi-square), every
    acceptance count of the first round (0, 1, 2) happened at least min_round times, and the same
    test catches a wrong acceptance rule (resampling from p), far off rather than borderline."""
    import specdistill.decode.spec  # noqa: F401  (loads the submodule for decode.<name>)
    from specdistill import decode
    from specdistill.drafters.parts.sampling import SamplingParams

    prompt, sp = [1, 2, 3, 4], SamplingParams(temperature=1.0, top_k=6)
    joint = pair_joint(tgt, prompt, sp)  # (V*V,)
    c, first_round = pair_counts(tgt, drafter, prompt, sp, n)
    assert bool((first_round > min_round).all()), first_round
    stat, crit = chi2_stat(c, joint)
    assert stat < crit, (stat, crit)
    monkeypatch.setattr(decode.spec, "accept_chain", wrong_rule("resample_from_p"))
    stat, crit = chi2_stat(pair_counts(tgt, drafter, prompt, sp, wrong_n)[0], joint)
    assert stat > 3 * crit, (stat, crit)
