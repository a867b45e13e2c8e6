import cProfile, pstats, tempfile, pathlib, itertools
from tests.test_structured_engine import *
from tests.conftest import make_tiny_checkpoint
d = pathlib.Path(tempfile.mkdtemp())
t = make_tiny_checkpoint(d/"t", seed=3, vocab_size=VOCAB, hidden_size=32)
dr = make_tiny_checkpoint(d/"d", seed=4, vocab_size=VOCAB, hidden_size=16, num_layers=1)
e = engine_for(t, dr, SAMPLED["tree"], max_running=600)
params = SamplingParams(temperature=TEMPERATURE, max_tokens=OUT_LEN, structured=REGEX)
cProfile.run("e.generate([PROMPT]*600, params)", "/tmp/prof")
pstats.Stats("/tmp/prof").sort_stats("cumulative").print_stats(30)
