// kvblend's page (GET /) in Debian's Chromium, headless, driven by playwright-core:
// it connects with the API key, adds a document holding markup (shown as text, never
// run), answers a question with its stats and the full prefill beside it, and shows
// the errors of a wrong key, an unknown document and a server that cannot be reached;
// the model's calibration plotted when the server has one.
// usage: node web_page.mjs BASE_URL API_KEY [SCREENSHOT.png]
import assert from "node:assert/strict";
import { chromium } from "playwright-core";

const [base, key, shot] = process.argv.slice(2);
const root = base.replace(/\/v1\/?$/, "");
const browser = await chromium.launch({
  executablePath: process.env.KVBLEND_CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1200, height: 800 } });
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(e.message));

  await page.goto(root + "/");
  // no key yet: the page says why it cannot connect
  await page.waitForSelector("#error:not([hidden])");
  assert.match(await page.textContent("#error"), /401/);
  await page.fill("#api-key", key);
  await page.dispatchEvent("#api-key", "change");
  await page.waitForFunction(() => document.getElementById("error").hidden);
  assert.match(await page.textContent("#model"), /slot/);

  // the server's calibration, when it has one: two series of one point per ratio, the slider's mark follows it
  const props = await (await fetch(root + "/props", { headers: { Authorization: "Bearer " + key } })).json();
  const cal = props.kvblend.calibration;
  assert.equal(await page.isHidden("#calibration"), !cal);
  const slide = (v) => page.$eval("#ratio", (el, v) => {
    el.value = v;
    el.dispatchEvent(new Event("input"));
  }, v);
  if (cal) {
    assert.equal((await page.$$("#cal-plot circle")).length, 2 * cal.rows.length);
    const mark = async () => page.evaluate(() => [...document.querySelectorAll("#cal-plot line")].pop().getAttribute("x1"));
    const before = await mark();
    await slide("0");
    const atZero = await mark();
    await slide("1");
    assert.notEqual(await mark(), atZero);
    await slide(String(props.kvblend.recomp_ratio));
    assert.equal(await mark(), before);
  }

  // a document with markup: stored, listed as text, never run
  const doc = "Tom had a red ball. <script>window.__ran = 1</script><b id=\"bold\">He threw it</b> over the fence.";
  await page.fill("#doc-text", doc);
  await page.click("#add-doc");
  await page.waitForSelector("#doc-list li");
  assert.equal((await page.textContent("#doc-list .title")).trim(), doc.slice(0, 80).trim());
  assert.equal(await page.evaluate(() => window.__ran), undefined);
  assert.equal(await page.$("#doc-list b"), null);
  assert.equal(await page.$("#bold"), null);

  // a question over it at 0.3 recomputed: the answer streams in, the stats and the full prefill beside it
  await slide("0.3");
  await page.fill("#question", "Once upon a time");
  await page.check("#compare");
  await page.click("#ask");
  await page.waitForSelector("#full-stats tr");
  assert.ok((await page.textContent("#answer")).length > 0, "an answer");
  assert.ok((await page.textContent("#full-answer")).length > 0, "the full prefill's answer");
  const stats = await page.textContent("#stats");
  assert.match(stats, /fused \/ recomputed/);
  assert.match(stats, /KL to the full prefill/);
  assert.match(stats, /time to first token/);
  assert.match(await page.textContent("#spans"), /Tom had a red ball/);
  // the document as the server cut it, its recomputed tokens marked, its markup still text
  assert.match(await page.textContent("#spans .doc-text"), /Tom had a red ball/);
  assert.match(await page.textContent("#spans .doc-text"), /<b id="bold">/);
  assert.ok(await page.$("#spans .doc-text mark"), "recomputed tokens are marked");
  assert.equal(await page.$("#spans .doc-text b"), null);
  assert.equal(await page.evaluate(() => window.__ran), undefined);
  if (shot) await page.screenshot({ path: shot, fullPage: true });

  // a document id the store does not hold: the server's 404 is shown
  await page.evaluate(() => {
    const docs = JSON.parse(localStorage.getItem("kvblend.docs"));
    docs.push({ id: "0123456789abcdef0123456789abcdef", n_tokens: 3, text: "gone", title: "gone", picked: true });
    localStorage.setItem("kvblend.docs", JSON.stringify(docs));
  });
  await page.reload();
  await page.fill("#question", "Once upon a time");
  await page.click("#ask");
  await page.waitForSelector("#error:not([hidden])");
  assert.match(await page.textContent("#error"), /404: unknown document id/);

  // a server that cannot be reached
  await page.route("**/v1/chat/completions", (r) => r.abort());
  await page.click("#ask");
  await page.waitForFunction(() => /cannot be reached/.test(document.getElementById("error").textContent));

  // a wrong key
  await page.unroute("**/v1/chat/completions");
  await page.fill("#api-key", "wrong");
  await page.dispatchEvent("#api-key", "change");
  await page.waitForFunction(() => /401/.test(document.getElementById("error").textContent));

  assert.deepEqual(pageErrors, []);
  console.log("all checks passed");
} finally {
  await browser.close();
}
