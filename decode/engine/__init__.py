"""Real serving engines as the judge of our exports (`python -m decode.engine`).

    python -m decode.engine export=exports/e3-vllm engine=vllm eval.limit=20 max_new_tokens=128

check.py runs the check (engine outputs, acceptance and speed against our decoder on the same
text), envs.py installs vLLM into its own cached environment and llamacpp_build.py builds
llama.cpp (both through install.py), vllm_engine.py drives vLLM through vllm_worker.py (which runs
inside vLLM's virtualenv and imports nothing of ours).
"""
