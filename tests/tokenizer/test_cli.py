"""keel tokenize / detokenize against the HF tokenizers fixture cases, and their failures."""
import json
import os
import subprocess
import sys

KEEL = os.environ.get("KEEL_BIN")
FIX = os.path.join(os.environ.get("KEEL_FIXTURES", "../shared/fixtures"), "nemotron_h_tiny")
TMP = os.environ.get("KEEL_TMP", "/tmp")


def keel(*args):
    return subprocess.run([KEEL, *args], capture_output=True)


def expect_fail(args, *words):
    r = keel(*args)
    err = r.stderr.decode(errors="replace")
    if r.returncode == 0 or not all(w in err for w in words):
        sys.exit(f"keel {' '.join(args)}: rc {r.returncode}, stderr {err!r}; expected failure naming {words}")


def main():
    if not KEEL or not os.path.exists(KEEL):
        print("KEEL_BIN not set or missing")
        return 77
    cases = json.load(open(os.path.join(FIX, "tokenizer_cases.json"), encoding="utf-8"))
    for c in cases:
        text, want = c["text"], c["ids"]
        r = keel("tokenize", FIX, text, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == want, (text, r.stdout)
        r = keel("tokenize", FIX, text)
        assert r.returncode == 0, r.stderr
        assert [int(x) for x in r.stdout.split()] == want, (text, r.stdout)
        for sep in (",", " "):
            r = keel("detokenize", FIX, sep.join(map(str, want)))
            assert r.returncode == 0, r.stderr
            assert r.stdout.decode("utf-8") == text + "\n", (text, r.stdout)
    # MODEL_DIR may also be the tokenizer.json itself; ids may come as several arguments
    r = keel("detokenize", os.path.join(FIX, "tokenizer.json"), "10,", "11")
    assert r.returncode == 0 and r.stdout == b"<|im_start|><|im_end|>\n", r
    missing = os.path.join(TMP, "h4-no-such-model")
    expect_fail(["tokenize", missing, "hi"], "tokenizer.json", "cannot open")
    expect_fail(["detokenize", missing, "1"], "tokenizer.json", "cannot open")
    expect_fail(["detokenize", FIX, "1,2,abc"], "abc", "position 2")
    expect_fail(["detokenize", FIX, "1,2.5"], "2.5")
    expect_fail(["detokenize", FIX, "99999999999"], "99999999999")
    expect_fail(["detokenize", FIX, "3 512"], "512", "outside the vocabulary")
    expect_fail(["detokenize", FIX, "-1"], "-1")
    expect_fail(["tokenize", FIX], "usage")
    expect_fail(["detokenize", FIX], "usage")
    expect_fail(["tokenize", FIX, "a", "b"], "unexpected argument")
    bad = os.path.join(TMP, "h4-bad-tokenizer")
    os.makedirs(bad, exist_ok=True)
    with open(os.path.join(bad, "tokenizer.json"), "w") as f:
        f.write('{"model": {"type": "Unigram"}}')
    expect_fail(["tokenize", bad, "hi"], os.path.join(bad, "tokenizer.json"), "model.type", "Unigram")
    print(f"{len(cases)} cases through keel tokenize/detokenize")
    return 0


if __name__ == "__main__":
    sys.exit(main())
