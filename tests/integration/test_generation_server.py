"""The generation server as people use it: its page in a real headless browser (Chromium through
Selenium) types a prompt and shows the completion the API gives; under load from 8 threads every
good request gets its text and every malformed one a 400, and the server keeps serving."""
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.corpus import tiny_gpt_args
from tests.harness.launch import ROOT, env

TRAIN = ["--train-iters", "6", "--log-interval", "3", "--eval-iters", "0", "--lr", "3e-3",
         "--save-interval", "1000"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(tiny_corpus, tmp_path_factory):
    """tools/run_text_generation_server.py on a tiny checkpoint, on 127.0.0.1 and a free port;
    yields its base URL and stops it (SIGTERM) afterwards."""
    from pretrain_gpt2 import run as pretrain
    tmp = tmp_path_factory.mktemp("server")
    pretrain(tiny_gpt_args(tiny_corpus, tmp, *TRAIN, "--save", str(tmp / "ck")))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tools", "run_text_generation_server.py"), "--load",
         str(tmp / "ck"), "--vocab-file", tiny_corpus["vocab"], "--merge-file",
         tiny_corpus["merges"], "--host", "127.0.0.1", "--port", "0", "--max-batch-size", "4",
         "--max-request-bytes", "65536"],
        cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    deadline, url = time.time() + 120, None
    while url is None and time.time() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line.startswith("serving on "):
            url = line.split()[2].rsplit("/api", 1)[0]
    try:
        assert url, f"the server did not start (exit {proc.poll()})"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def call(url, body=None, raw=None, method="PUT", timeout=60):
    """(status, parsed JSON reply) of one request to /api."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/api", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


PROMPTS = ["import os\n", "def main(", "class A", "return self.", "for i in range(", "x = "]
MALFORMED = [  # (body, raw bytes, what the error names)
    (None, b"{not json", "not valid JSON"), (["x"], None, "JSON object"),
    ({"prompts": "x"}, None, "prompts"), ({"prompts": []}, None, "prompts"),
    ({"prompts": [""]}, None, "prompts"), ({"prompts": ["x"], "foo": 1}, None, "unknown field"),
    ({"prompts": ["x"], "top_p": 1.5}, None, "top_p"),
    ({"prompts": ["x"], "tokens_to_generate": "5"}, None, "tokens_to_generate"),
    ({"prompts": ["x"], "tokens_to_generate": 0}, None, "max_new_tokens"),
    ({"prompts": ["x"], "tokens_to_generate": 10 ** 9}, None, "positions"),
    ({"prompts": ["x " * 40]}, None, "positions"), ({"prompts": ["x"] * 5}, None, "batch limit"),
    ({"prompts": ["x"], "beam_width": 50}, None, "batch limit"),
]


def test_load_from_8_threads_good_answered_bad_refused_server_alive(server):
    """240 requests from 8 threads, a fifth malformed: every good one is 200 with its prompt's
    text (the same text for the same greedy prompt, however the requests interleave), every
    malformed one 400 naming the problem; a body over the limit gets 413; the server serves
    the page and requests afterwards."""
    jobs = []
    for i in range(240):
        if i % 5 == 4:
            jobs.append(("bad", MALFORMED[(i // 5) % len(MALFORMED)]))
        else:
            jobs.append(("good", {"prompts": [PROMPTS[i % len(PROMPTS)]],
                                  "tokens_to_generate": 1 + i % 3}))

    def send(job):
        kind, spec = job
        if kind == "good":
            return job, call(server, spec)
        body, raw, _ = spec
        return job, call(server, body, raw=raw)

    started = time.time()
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(send, jobs))
    texts = {}
    for (kind, spec), (status, reply) in results:
        if kind == "good":
            assert status == 200, (spec, reply)
            (text,) = reply["text"]
            assert text.startswith(spec["prompts"][0])
            key = (spec["prompts"][0], spec["tokens_to_generate"])
            assert texts.setdefault(key, text) == text, key
        else:
            assert status == 400 and spec[2] in reply["error"], (spec, status, reply)
    assert len(texts) == len(PROMPTS) and time.time() - started < 300
    status, reply = call(server, raw=b'{"prompts": ["' + b"x" * 70000 + b'"]}')
    assert status == 413 and "65536" in reply["error"]
    with urllib.request.urlopen(f"{server}/", timeout=30) as page:
        assert page.status == 200 and b"<textarea" in page.read()
    assert call(server, {"prompts": ["def"], "tokens_to_generate": 2})[0] == 200


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="Chromium is not installed: apt-get install -y chromium chromium-driver "
                           "(Debian) to run the browser test")
def test_page_in_a_headless_browser_shows_the_completion(server, tmp_path):
    selenium = pytest.importorskip("selenium", reason="pip install selenium for the browser test")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    assert selenium
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(60)
        driver.get(f"{server}/")
        assert driver.title == "GPT-2 text generation"
        prompt = "def main(argv):\n    "
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        tokens = driver.find_element(By.ID, "tokens")
        tokens.clear()
        tokens.send_keys("6")
        driver.find_element(By.ID, "generate").click()
        WebDriverWait(driver, 60).until(
            lambda d: d.find_element(By.ID, "completion").get_attribute("data-done")
            or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        shown = driver.execute_script("return document.getElementById('completion').textContent")
        status, want = call(server, {"prompts": [prompt], "tokens_to_generate": 6})
        assert status == 200 and shown == want["text"][0]
        assert driver.find_element(By.ID, "generated").text.strip() == want["generated_text"][0].strip()
        driver.save_screenshot(str(tmp_path / "page.png"))
        top_p = driver.find_element(By.ID, "top_p")
        top_p.clear()
        top_p.send_keys("1.5")
        driver.find_element(By.ID, "generate").click()
        WebDriverWait(driver, 60).until(
            lambda d: d.find_element(By.ID, "error").get_attribute("data-done"))
        assert "top_p" in driver.find_element(By.ID, "error").text
    finally:
        driver.quit()
