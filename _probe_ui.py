import os, time, socket
os.environ["SHOWCASE_CACHE_DIR"]="/work/main/.cache/test"; os.environ["GRADIO_ANALYTICS_ENABLED"]="False"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR","/work/main/.cache/test/inductor"); os.environ["HF_HUB_OFFLINE"]="1"; os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"]="0"
def main():
    from engine.manager import EngineManager
    from engine.recipes import EngineOptions
    from ui import build_demo, launch_kwargs
    from ui.handlers import UIDefaults
    m=EngineManager(options=EngineOptions(warm_sizes=()))
    demo=build_demo(m, UIDefaults(device="cpu"))
    s=socket.socket(); s.bind(("127.0.0.1",0)); port=s.getsockname()[1]; s.close()
    demo.launch(prevent_thread_lock=True, server_port=port, ssr_mode=False, quiet=True, **launch_kwargs())
    url=f"http://127.0.0.1:{port}/"
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b=p.chromium.launch(executable_path="/usr/bin/chromium", args="--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-background-networking --disable-component-update --disable-sync --no-first-run".split())
        pg=b.new_page(viewport={"width":1400,"height":1000})
        pg.on("console", lambda msg: print("console:", msg.type, msg.text[:200]) if msg.type in ("error",) else None)
        t=time.time(); pg.goto(url); pg.wait_for_selector("#generate-btn"); print("render", time.time()-t)
        pg.wait_for_timeout(1500)
        pg.screenshot(path="artifacts/probe0.png", full_page=True)
        t=time.time(); pg.click("#generate-btn")
        pg.wait_for_selector("#output-image img", timeout=120000); print("gen", time.time()-t)
        pg.wait_for_timeout(1500)
        pg.screenshot(path="artifacts/probe1.png", full_page=True)
        print(pg.evaluate("""() => Array.from(document.querySelectorAll('#step-plot svg path')).map(p => (p.getAttribute('class')||'') + ' ' + (p.getAttribute('d')||'').slice(0,200))"""))
        print(pg.evaluate("""() => Array.from(document.querySelectorAll('#step-plot svg g')).map(g => g.getAttribute('class')).filter(Boolean).slice(0,40)"""))
        b.close()
    demo.close(); m.shutdown()
if __name__=="__main__": main()
