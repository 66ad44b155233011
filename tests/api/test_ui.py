"""The web UI and /docs in a real headless browser (Debian's chromium through chromedriver,
driven by selenium), against the real API and worker: sign in, a job submitted from the CLI
watched live, its report's plots, a download, keyboard use, a phone-width screen, and Swagger
UI served offline with an Authorize button; an auto adapt job's diagnostics and candidates.
Screenshots are kept under the test's tmp dir (the path is printed); with
BNADAPT_UPDATE_UI_SCREENSHOT=1 the wide ones replace docs/ui.png and docs/ui-auto.png."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.answers import created
from harness.digits import digits_npz
from harness.servers import wait_for
from harness.stack import REPO, Stack

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:  # .ci/run installs both where it can
    if os.environ.get("CI") == "true":  # never skipped in CI: a missing browser fails it
        pytest.fail("CI=true but chromium or chromedriver is missing", pytrace=False)
    pytest.skip("needs chromium and chromedriver", allow_module_level=True)

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[tuple[WebDriver, Path]]:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(downloads), "download.prompt_for_download": False},
    )
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    try:
        yield driver, downloads
    finally:
        driver.quit()


def shot(driver: WebDriver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def wait_css(driver: WebDriver, css: str, timeout_s: float = 30) -> Any:
    return wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, css),
        timeout_s=timeout_s,
        interval_s=0.2,
        what=f"{css} on {driver.current_url}",
    )[0]


def sign_in(driver: WebDriver, stack: Stack, key: str) -> None:
    driver.get(f"{stack.url}/dashboard")  # redirects to the UI
    field = wait_css(driver, "#apikey")
    field.send_keys("bna_not_a_key_x")
    field.send_keys(Keys.ENTER)
    wait_for(
        lambda: "not valid" in driver.find_element(By.CSS_SELECTOR, ".signin .error").text,
        what="the refusal of a wrong key",
    )
    field = driver.find_element(By.CSS_SELECTOR, "#apikey")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#signin").click()
    wait_css(driver, "table#jobs")


def test_ui_sign_in_watch_a_cli_job_live_and_read_its_report(
    stack: Stack, browser: tuple[WebDriver, Path], tmp_path: Path
) -> None:
    driver, downloads = browser
    client = stack.client("ui")
    key = str(client.http.headers["authorization"]).split(" ", 1)[1]
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=0))
    dataset = created(client.add_dataset(digits_npz()))
    other = stack.client("someone-else")
    hidden = created(other.add_model("digits_cnn", {"width": 4}, seed=0))

    sign_in(driver, stack, key)
    env = {**stack.env, "BNADAPT_URL": stack.url, "BNADAPT_API_KEY": key}
    submitted = subprocess.run(
        [sys.executable, "-m", "service.local.cli", "jobs", "submit", "train",
         "--model", model["id"], "--dataset", dataset["id"], "--tag", "from=cli",
         "--params", '{"epochs": 25, "batch_size": 16, "validation_fraction": 0.1}'],
        env=env, cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    job_id = created_id(submitted.stdout)

    driver.get(f"{stack.url}/ui/#/jobs?tag=from:cli")
    link = wait_css(driver, f"a[href='#/jobs/{job_id}']")
    link.click()
    # Live: the progress text and the epochs' curve change while the job runs, from the event
    # stream.
    seen, epochs_seen = set(), set()

    def progressed() -> bool:
        progress = driver.find_elements(By.CSS_SELECTOR, "#progress")
        status = driver.find_elements(By.CSS_SELECTOR, "#job-status")
        if not (progress and status):
            return False  # the page is still loading
        seen.add(progress[0].text)
        # Read in the page, in one step: the card is redrawn at each event.
        epoch = driver.execute_script(
            "const e = document.querySelector('#epochs-live:not([hidden]) #epoch-text');"
            "return e ? e.textContent : null"
        )
        if epoch:
            epochs_seen.add(epoch)
        return bool(status[0].text == "succeeded")

    wait_for(progressed, timeout_s=240, interval_s=0.3, what="the job to succeed on its page")
    live = [t for t in seen if t.startswith("train:")]
    assert len(live) >= 2, f"no live progress seen: {seen}"
    # Each validated epoch as it came, up to the last, with its curve.
    assert len(epochs_seen) >= 2, f"no live epochs seen: {epochs_seen}"
    assert all(t.startswith("epoch ") and "val loss" in t for t in epochs_seen), epochs_seen
    assert driver.find_element(By.CSS_SELECTOR, "#epoch-text").text.startswith("epoch 25/25")
    assert driver.find_elements(By.CSS_SELECTOR, "#plot-epochs-live polyline")
    # Each line's name in the legend is drawn in that line's color.
    legends = driver.find_elements(By.CSS_SELECTOR, "#plot-epochs-live text[fill]")
    assert [legend.text for legend in legends] == ["train loss", "val loss"]
    for legend in legends:
        line = driver.find_element(
            By.CSS_SELECTOR, f"#plot-epochs-live polyline[stroke='{legend.get_attribute('fill')}']"
        )
        drawn = driver.execute_script("return getComputedStyle(arguments[0]).fill", legend)
        assert drawn == driver.execute_script("return getComputedStyle(arguments[0]).stroke", line)
    for plot in ("#plot-epochs", "#plot-loss", "#plot-mean-shift", "#plot-var-ratio"):
        wait_css(driver, plot, timeout_s=30)
    assert driver.find_elements(By.CSS_SELECTOR, "#plot-epochs polyline")
    assert "started" in driver.find_element(By.CSS_SELECTOR, "#logs").text
    driver.set_window_size(1280, 1900)  # the whole page, report included
    wide = shot(driver, tmp_path, "job-1280")
    driver.set_window_size(1280, 900)
    if os.environ.get("BNADAPT_UPDATE_UI_SCREENSHOT") == "1":
        shutil.copy(wide, REPO / "docs" / "ui.png")

    driver.find_element(By.CSS_SELECTOR, "#download-weights").click()
    weights = wait_for(
        lambda: [p for p in downloads.glob("*.safetensors") if p.stat().st_size > 0],
        timeout_s=30,
        what="the downloaded weights",
    )
    assert weights[0].read_bytes()[:8], "a safetensors header"

    # Models: lineage (parent and job) and only this tenant's.
    driver.get(f"{stack.url}/ui/#/models")
    table = wait_css(driver, "table#models")
    assert model["id"] in table.text and job_id in table.text
    assert hidden["id"] not in table.text
    driver.get(f"{stack.url}/ui/#/datasets")
    assert dataset["id"] in wait_css(driver, "table#datasets").text

    # Keyboard: from the top of the page, Tab reaches the navigation and the job's link.
    driver.get(f"{stack.url}/ui/#/jobs")
    wait_css(driver, f"a[href='#/jobs/{job_id}']")
    driver.find_element(By.TAG_NAME, "body").click()
    reached = []
    for _ in range(30):
        driver.switch_to.active_element.send_keys(Keys.TAB)
        active = driver.switch_to.active_element
        reached.append(active.get_attribute("href") or active.text)
    assert any(str(r).endswith("#/models") for r in reached), reached
    assert any(str(r).endswith(f"#/jobs/{job_id}") for r in reached), reached
    driver.switch_to.active_element.send_keys(Keys.ENTER)

    # A phone's width: nothing wider than the screen (tables scroll inside their box).
    driver.set_window_size(375, 800)
    driver.get(f"{stack.url}/ui/#/jobs/{job_id}")
    wait_css(driver, "#plot-var-ratio")
    overflow = driver.execute_script(
        "return document.documentElement.scrollWidth - window.innerWidth"
    )
    assert overflow <= 0, f"the page is {overflow} px wider than a 375 px screen"
    shot(driver, tmp_path, "job-375")


def ui_number(value: float, digits: int = 4) -> str:
    """A number as the UI's ``fmt`` writes it (service/api/ui/app.js)."""
    if float(value).is_integer():
        return str(int(value))
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa}e{int(exponent):+d}"
    return f"{value:.{digits}f}"


def test_ui_draws_the_diagnostics_and_the_auto_choice(
    stack: Stack, browser: tuple[WebDriver, Path], tmp_path: Path
) -> None:
    driver, _ = browser
    client = stack.client("ui-auto")
    key = str(client.http.headers["authorization"]).split(" ", 1)[1]
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=0))
    dataset = created(client.add_dataset(digits_npz(shifted=True, n=600)))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"],
            "params": {"estimator": "auto", "batch_size": 50}}  # fmt: skip
    job = client.wait(created(client.submit(body), 202)["id"], timeout_s=240)
    assert job["status"] == "succeeded", job
    report = client.http.get(f"/v1/jobs/{job['id']}/report").json()
    diagnostics, auto = report["diagnostics"], report["auto"]
    assert diagnostics is not None and auto is not None

    sign_in(driver, stack, key)
    driver.get(f"{stack.url}/ui/#/jobs/{job['id']}")
    table = wait_css(driver, "#diagnostics-table")
    rows = {
        row.find_element(By.TAG_NAME, "th").text: [
            cell.text for cell in row.find_elements(By.TAG_NAME, "td")
        ]
        for row in table.find_elements(By.CSS_SELECTOR, "tbody tr")
    }
    for label, field in (
        ("mean entropy (nats)", "mean_entropy"),
        ("mean max probability", "mean_max_probability"),
        ("marginal entropy (nats)", "marginal_entropy"),
    ):
        assert rows[label] == [
            ui_number(diagnostics["before"][field]),
            ui_number(diagnostics["after"][field]),
        ], rows
    assert rows["predictions changed"] == [f"{100 * diagnostics['changed_fraction']:.1f}%"]
    assert f"{diagnostics['samples']} held-out samples" in table.text
    assert driver.find_elements(By.CSS_SELECTOR, "#plot-entropy rect")

    # The candidates, one row each in the report's order, the chosen one marked, and the choice.
    candidates = driver.find_elements(By.CSS_SELECTOR, "#auto-candidates tbody tr")
    assert len(candidates) == len(auto["candidates"])
    for row, candidate in zip(candidates, auto["candidates"], strict=True):
        cells = [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
        assert cells[0].startswith(candidate["name"]), cells
        assert cells[4] == ui_number(candidate["score"]), cells
        assert cells[6] == ("yes" if candidate["eligible"] else "no"), cells
    chosen = driver.find_elements(By.CSS_SELECTOR, "#auto-candidates tr.chosen")
    assert len(chosen) == 1 and chosen[0] == candidates[auto["chosen_index"]]
    choice = driver.find_element(By.CSS_SELECTOR, "#auto-choice").text
    expected = (
        "auto kept the source model unchanged"
        if auto["kept_source"]
        else f"auto chose {auto['chosen']}"
    )
    assert choice == expected
    bars = driver.find_elements(By.CSS_SELECTOR, "#plot-auto-scores rect")
    assert len(bars) == len(auto["candidates"])
    driver.set_window_size(1280, 2200)
    wide = shot(driver, tmp_path, "auto-job-1280")
    if os.environ.get("BNADAPT_UPDATE_UI_SCREENSHOT") == "1":
        shutil.copy(wide, REPO / "docs" / "ui-auto.png")


def created_id(stdout: str) -> str:
    import json

    job: dict[str, Any] = json.loads(stdout)
    return str(job["id"])


def test_docs_render_offline_with_authorize(
    stack: Stack, browser: tuple[WebDriver, Path], tmp_path: Path
) -> None:
    driver, _ = browser
    driver.get(f"{stack.url}/docs")
    title = wait_css(driver, ".swagger-ui .info .title")
    assert "bnadapt" in title.text
    assert wait_css(driver, ".swagger-ui .btn.authorize")
    assert driver.find_elements(By.CSS_SELECTOR, ".opblock-tag-section")
    resources = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    outside = [r for r in resources if not r.startswith(stack.url)]
    assert outside == [], f"/docs fetched from elsewhere: {outside}"
    shot(driver, tmp_path, "docs")
