"""The recipe study's arms (benchmarks/recipe_study.py): each a name, what it tests and its Hydra
overrides on top of the default job's trainer (conf/train.yaml without its budget specialization,
conf/budget/: every arm names its whole recipe, so an arm means the same whatever the default is)."""
from __future__ import annotations

# EAGLE-3 ttt 1 on the target's own answers to 1200 prompts: the candidate default's overrides
SG1200 = ["drafter=eagle3", "drafter.ttt_length=1", "data=sharegpt_selfgen", "data.selfgen.prompts=1200"]

# the default job's recipe (conf/budget/default_eagle3.yaml) as overrides
ARMS_E3_OP_R1 = ["drafter=eagle3", "drafter.ttt_length=1", "trainer.on_policy_heads_start=0.8",
                 "trainer.on_policy_heads_rows=1", "trainer.on_policy_heads_anchors=1.0"]

# name -> (what it tests, overrides on top of conf/train.yaml with `~budget`)
ARMS: dict[str, tuple[str, list[str]]] = {
    "eagle": ("EAGLE-1 (the default until 2026-12-03), teacher-forced", ["drafter=eagle"]),
    # precision = auto picks these per machine (bf16 only where native): forced, for A/B steps
    "eagle_fp32": ("EAGLE-1, drafter and target's forwards in fp32", [
        "drafter=eagle", "trainer.precision=fp32", "trainer.capture_autocast=null"]),
    "eagle_bf16": ("EAGLE-1, drafter and target's forwards under bf16 autocast", [
        "drafter=eagle", "trainer.precision=bf16", "trainer.capture_autocast=bfloat16"]),
    "eagle_u2": ("EAGLE-1, 2-step unroll", ["drafter=eagle", "drafter.train_unroll=2"]),
    "eagle_lr3": ("EAGLE-1, lr 3e-3", ["drafter=eagle", "trainer.lr=3e-3"]),
    "eagle_lr2": ("EAGLE-1, lr 2e-3", ["drafter=eagle", "trainer.lr=2e-3"]),
    "eagle_flat": ("EAGLE-1, no cosine decay (constant lr after warm-up)", [
        "drafter=eagle", "trainer.min_lr_ratio=1.0"]),
    "eagle_init": ("EAGLE-1, layer from the target's last", [
        "drafter=eagle", "drafter.init_from_target_layer=-1"]),
    "eagle_v4k": ("EAGLE-1, draft vocab 4k", ["drafter=eagle", "drafter.draft_vocab_size=4096"]),
    "eagle_v16k": ("EAGLE-1, draft vocab 16k", ["drafter=eagle", "drafter.draft_vocab_size=16384"]),
    # tokens vs passes at equal steps: the first half / quarter / eighth of the default split's 815
    # conversations (at 300 steps x 4: 2.9 / 5.9 / 11.8 passes instead of 1.5)
    "eagle_d50": ("EAGLE-1, the first 408 conversations", [
        "drafter=eagle", "trainer.train_conversations=408"]),
    "eagle_d25": ("EAGLE-1, the first 204 conversations", [
        "drafter=eagle", "trainer.train_conversations=204"]),
    "eagle_d12": ("EAGLE-1, the first 102 conversations", [
        "drafter=eagle", "trainer.train_conversations=102"]),
    "eagle_tv": ("EAGLE-1, TV loss (1 - acceptance)", ["drafter=eagle", "trainer.loss=tv"]),
    "eagle_lk": ("EAGLE-1, LK hybrid loss", ["drafter=eagle", "trainer.loss=lk_hybrid"]),
    "e3_ttt1": ("EAGLE-3, no training-time test", ["drafter=eagle3", "drafter.ttt_length=1"]),
    "e3_ttt1_op": ("EAGLE-3, no training-time test, on-policy heads (depth 2) in the last 20%", [
        "drafter=eagle3", "drafter.ttt_length=1", "trainer.on_policy_heads_start=0.8"]),
    "e3_op0": ("EAGLE-3, no training-time test, on-policy heads from step 0 (step profiles)", [
        "drafter=eagle3", "drafter.ttt_length=1", "trainer.on_policy_heads_start=0"]),
    "e3_op0_r1": ("EAGLE-3, no training-time test, on-policy heads from step 0, one row's drafts "
                  "scored at every anchor (step profiles)", [
        "drafter=eagle3", "drafter.ttt_length=1", "trainer.on_policy_heads_start=0",
        "trainer.on_policy_heads_rows=1", "trainer.on_policy_heads_anchors=1.0"]),
    # less padding: each run of 16 global batches sorted by length and cut again (train/batches.py),
    # the same rows per epoch (BENCHMARKS.md "Length-grouped batches"; no faster per real token)
    "e3_ttt1_g16": ("EAGLE-3 ttt 1, batches of similar lengths (step profiles)", [
        "drafter=eagle3", "drafter.ttt_length=1", "trainer.group_by_length=16"]),
    "e3_ttt1_op_r1": ("EAGLE-3, no training-time test, on-policy heads in the last 20%, one row's "
                      "drafts scored at every anchor", ARMS_E3_OP_R1),
    "e3_ttt2": ("EAGLE-3, ttt 2", ["drafter=eagle3", "drafter.ttt_length=2"]),
    "e3_ttt3": ("EAGLE-3, ttt 3", ["drafter=eagle3", "drafter.ttt_length=3"]),
    "e3_ttt2_tv": ("EAGLE-3, ttt 2, TV loss", ["drafter=eagle3", "drafter.ttt_length=2",
                                               "trainer.loss=tv"]),
    "e3_ttt2_lk": ("EAGLE-3, ttt 2, LK hybrid loss", ["drafter=eagle3", "drafter.ttt_length=2",
                                                      "trainer.loss=lk_hybrid"]),
    "e3_ttt2_init": ("EAGLE-3, ttt 2, layer from the target's last", [
        "drafter=eagle3", "drafter.ttt_length=2", "drafter.init_from_target_layer=-1"]),
    "e3_ttt2_lr3": ("EAGLE-3, ttt 2, lr 3e-3", ["drafter=eagle3", "drafter.ttt_length=2",
                                                "trainer.lr=3e-3"]),
    "e3_ttt2_v32k": ("EAGLE-3, ttt 2, draft vocab 32k", [
        "drafter=eagle3", "drafter.ttt_length=2", "drafter.draft_vocab_size=32768"]),
    "e3_ttt2_31": ("EAGLE-3.1 norms, ttt 2", ["drafter=eagle3", "drafter.ttt_length=2",
                                              "drafter.fc_norm=true", "drafter.norm_output=true"]),
    "peagle": ("P-EAGLE (all k drafts from one forward)", ["drafter=peagle"]),
    "peagle_a25": ("P-EAGLE, masks trained at 1/4 of the anchors", [
        "drafter=peagle", "drafter.mask_anchors=0.25"]),
    "peagle_a10": ("P-EAGLE, masks trained at 1/10 of the anchors", [
        "drafter=peagle", "drafter.mask_anchors=0.1"]),
    "dflash": ("DFlash as conf/drafter/dflash.yaml (block of 4, blocks at 1/10 of the anchors)",
               ["drafter=dflash"]),
    "dflash_b4": ("DFlash, block of 4 (3 drafts), blocks at 1/10 of the anchors", [
        "drafter=dflash", "drafter.block_size=4", "drafter.anchors=0.1"]),
    "dflash_a50": ("DFlash, block of 8, blocks at 1/2 of the anchors", [
        "drafter=dflash", "drafter.block_size=8", "drafter.anchors=0.5"]),
    "dflash_a25": ("DFlash, block of 8, blocks at 1/4 of the anchors", [
        "drafter=dflash", "drafter.block_size=8", "drafter.anchors=0.25"]),
    "dflash_a10": ("DFlash, block of 8, blocks at 1/10 of the anchors", [
        "drafter=dflash", "drafter.block_size=8", "drafter.anchors=0.1"]),
    "dflash_a05": ("DFlash, block of 8, blocks at 1/20 of the anchors", [
        "drafter=dflash", "drafter.block_size=8", "drafter.anchors=0.05"]),
    "dflash_l2": ("DFlash, block of 8, blocks at 1/4 of the anchors, 2 draft layers", [
        "drafter=dflash", "drafter.block_size=8", "drafter.anchors=0.25", "drafter.num_layers=2"]),
    "dspark": ("DSpark as conf/drafter/dspark.yaml (DFlash's block of 4 + Markov rank 256 + confidence)",
               ["drafter=dspark"]),
    "dspark_noconf": ("DSpark without the confidence head (Markov head only)", [
        "drafter=dspark", "drafter.confidence_head=false"]),
    "dspark_gated": ("DSpark, gated Markov head", ["drafter=dspark", "drafter.markov_head_type=gated"]),
    "dspark_rnn": ("DSpark, rnn Markov head", ["drafter=dspark", "drafter.markov_head_type=rnn"]),
    "dspark_b8": ("DSpark, block of 8", ["drafter=dspark", "drafter.block_size=8"]),
    "dspark_greedy": ("DSpark, confidence trained on greedy agreement instead of 1 - TV", [
        "drafter=dspark", "drafter.confidence_target=greedy"]),
    # the target's own answers (data/selfgen.py: 1500 ShareGPT first turns answered greedily at
    # bf16, features from the same pass): no capture, rows of ~350 tokens instead of ~820
    "eagle_sg": ("EAGLE-1 on the target's own answers", ["drafter=eagle", "data=sharegpt_selfgen"]),
    "e3t1_sg": ("EAGLE-3 ttt 1 on the target's own answers", [
        "drafter=eagle3", "drafter.ttt_length=1", "data=sharegpt_selfgen"]),
    "e3t2_sg": ("EAGLE-3 ttt 2 on the target's own answers", [
        "drafter=eagle3", "drafter.ttt_length=2", "data=sharegpt_selfgen"]),
    "e3t1_sg_b8": ("EAGLE-3 ttt 1, own answers, batch 8", [
        "drafter=eagle3", "drafter.ttt_length=1", "data=sharegpt_selfgen", "trainer.batch_size=8"]),
    "e3t1_sg_g": ("EAGLE-3 ttt 1, own answers, length-grouped batches", [
        "drafter=eagle3", "drafter.ttt_length=1", "data=sharegpt_selfgen",
        "trainer.group_by_length=50"]),
    "e3t1_sg_op": ("EAGLE-3 ttt 1, own answers, on-policy heads (depth 2) in the last 20%", [
        "drafter=eagle3", "drafter.ttt_length=1", "data=sharegpt_selfgen",
        "trainer.on_policy_heads_start=0.8"]),
    "e3t1_sg3k": ("EAGLE-3 ttt 1, own answers to 3000 prompts", [
        "drafter=eagle3", "drafter.ttt_length=1", "data=sharegpt_selfgen",
        "data.selfgen.prompts=3000"]),
    # the candidate default job at the 45-minute budget: 1200 prompts (~250 k answer tokens,
    # ~17 min of generation at 250 tokens/s on 2 cores) leave the training its 1000 steps
    "e3t1_sg1200": ("EAGLE-3 ttt 1, own answers to 1200 prompts", SG1200),
    "e3t1_sg1200_op": ("EAGLE-3 ttt 1, own answers to 1200 prompts, on-policy heads in the last 20%",
                       [*SG1200, "trainer.on_policy_heads_start=0.8"]),
    "e3t1_sg1200_s2k": ("EAGLE-3 ttt 1, own answers to 1200 prompts (run as :2000 steps)", SG1200),
    # own answers are short rows (~1,300 target tokens a batch of 4 against ~3,500 for ShareGPT's
    # multi-turn conversations): batch 12 trains on as many answer tokens a step
    "e3t1_sg1200_b12": ("EAGLE-3 ttt 1, own answers to 1200 prompts, batch 12",
                        [*SG1200, "trainer.batch_size=12"]),
    "e3t1_sg1200_b8": ("EAGLE-3 ttt 1, own answers to 1200 prompts, batch 8",
                       [*SG1200, "trainer.batch_size=8"]),
    "dflash_sg": ("DFlash (conf/drafter/dflash.yaml) on the target's own answers", [
        "drafter=dflash", "data=sharegpt_selfgen"]),
    # a mix (data/mix.py): the default job's 815 ShareGPT conversations (the same capture) + the
    # target's answers to 600 first turns of the conversations after them
    "e3_op_mix": ("the default job's recipe (EAGLE-3 ttt 1 + on-policy heads) on ShareGPT + own answers "
                  "to 600 later prompts", [*ARMS_E3_OP_R1, "data=sharegpt_mix"]),
}
