#!/usr/bin/env python3
"""Screenshots the browser page after N training steps, in headless Chromium.

    scripts/build-web.sh /tmp/site && (cd /tmp/site && python3 -m http.server 8089 &)
    python3 scripts/web-screenshot.py http://127.0.0.1:8089/ shot.png --steps 50

Opens `index.html?autostart&stop=N` with the flags the Chromium test uses
(SwiftShader's WebGPU), waits until the page has paused at step N with its
sample written, prints the page's text and writes a PNG. Needs Debian's
`chromium` and the `websocket-client` package (Chrome's DevTools protocol).
"""
import argparse
import base64
import json
import subprocess
import tempfile
import time
import urllib.request

import websocket


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("site", help="where the page is served, e.g. http://127.0.0.1:8089/")
    p.add_argument("png")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--timeout", type=float, default=900, help="seconds before giving up")
    p.add_argument("--port", type=int, default=9333, help="Chromium's DevTools port")
    args = p.parse_args()
    chromium = subprocess.Popen(
        ["chromium", "--headless", "--no-sandbox", "--no-first-run", f"--remote-debugging-port={args.port}",
         "--remote-allow-origins=*", f"--user-data-dir={tempfile.mkdtemp()}", "--enable-unsafe-webgpu",
         "--use-webgpu-adapter=swiftshader", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        shoot(args)
    finally:
        chromium.kill()


def shoot(args):
    for _ in range(100):
        try:
            tabs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{args.port}/json"))
            break
        except OSError:
            time.sleep(0.2)
    else:
        raise SystemExit("web-screenshot: Chromium's DevTools did not answer")
    tab = next(t for t in tabs if t["type"] == "page")
    ws = websocket.create_connection(tab["webSocketDebuggerUrl"], timeout=args.timeout)
    ids = iter(range(1, 1 << 30))

    def call(method, **params):
        n = next(ids)
        ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            message = json.loads(ws.recv())
            if message.get("id") == n:
                return message.get("result", {})

    def value(expression):
        return call("Runtime.evaluate", expression=expression, returnByValue=True).get("result", {}).get("value")

    call("Emulation.setDeviceMetricsOverride", width=1280, height=1400, deviceScaleFactor=1, mobile=False)
    call("Page.navigate", url=f"{args.site.rstrip('/')}/index.html?autostart&stop={args.steps}")
    # Paused at step N, and the sample of step N written where the page
    # samples then (every 50 steps by default).
    done = f"document.getElementById('step').textContent.trim().startsWith('{args.steps} ')"
    if args.steps % 50 == 0:
        done += f" && document.getElementById('sample-step').textContent.includes('after step {args.steps} (')"
    started = time.time()
    while not value(done):
        if time.time() - started > args.timeout:
            raise SystemExit(f"web-screenshot: not at step {args.steps} after {args.timeout:.0f} s:\n"
                             + (value("document.body.innerText") or ""))
        time.sleep(2)
    print(value("document.body.innerText"))
    with open(args.png, "wb") as f:
        f.write(base64.b64decode(call("Page.captureScreenshot", format="png")["data"]))


if __name__ == "__main__":
    main()
