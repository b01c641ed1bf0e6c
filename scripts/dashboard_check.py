"""The dashboard in a real browser: headless Chromium (Debian's chromium + chromium-driver),
driven by Selenium, against a real `hearth serve` started here on a free port with a fresh
data directory.

It signs in with an API key, checks the usage numbers equal the sum of the `usage` the API
returned for requests it made, creates a key (which then works) and revokes it (which then
gets 401), uploads and activates a processor, uploads a LoRA adapter (both PEFT files in one
file input) and uses it, signs out, checks that a tenant named
`<img src=x onerror=alert(1)>` is shown as text (no alert, no element) and sees none of the
first tenant's data (its adapters included), and that the operator's view lists both tenants; the operator creates a
tenant and sets its budget from the console, and the CLI sees both. Then members: the
operator invites acme's first owner, who joins through the link, invites a viewer from the
Members page; the viewer joins and is shown no key, export or audit controls; the owner
signs in with the password and removes the viewer; acme's API key no longer signs in.
Then single sign-on through a real OpenID Connect provider (npm's `oidc-provider`, run under
node by scripts/oidc-provider): acme's owner and a viewer, both invited by address, sign in
through acme's provider and are shown what their roles allow; the viewer, removed by the CLI,
is refused at its next request; an operator signs in through the operators' provider (audited
under its address) and a tenant's member cannot; `hearth admin login` signs the operator in
through the browser and the CLI then creates a tenant without the admin token.
With --screenshots DIR
it saves the main pages there (the book's dashboard pictures, docs/book/src/screenshots, come from this run).

Usage: dashboard_check.py HEARTH_BINARY [--screenshots DIR]
"""
import json, os, socket, subprocess, sys, tempfile, time, urllib.error, urllib.request

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from harness import Checks, Serve, synthetic_adapter, upload_batch_file

hearth = sys.argv[1]
shots = None
if "--screenshots" in sys.argv:
    shots = sys.argv[sys.argv.index("--screenshots") + 1]
    os.makedirs(shots, exist_ok=True)
ADMIN = "dashboard-check-admin-token"
ODD = "<img src=x onerror=alert(1)>"
# The identity provider (scripts/oidc-provider) on a port chosen now: the gateway is told its
# issuer at start, the provider the gateway's callback once the gateway listens.
PROVIDER_JS = os.environ["HEARTH_OIDC_PROVIDER"]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    idp_port = s.getsockname()[1]
IDP = f"http://localhost:{idp_port}"
IDP_SECRET = "dashboard-check-client-secret"
# A catalogue with the default model, so that the console can add models at runtime.
catalogue = os.path.join(tempfile.mkdtemp(prefix="hearth-dashboard-catalogue-"), "catalogue.toml")
with open(catalogue, "w") as f:
    f.write('[[model]]\nid = "smollm2-135m-instruct"\nsource = "smollm2-135m-instruct"\n')
server = Serve(hearth, "dashboard", {"HEARTH_CATALOGUE": catalogue,
    "HEARTH_ADMIN_TOKEN": ADMIN, "HEARTH_OPERATOR_OIDC_ISSUER": IDP, "HEARTH_OPERATOR_OIDC_CLIENT_ID": "hearth",
    "HEARTH_OPERATOR_OIDC_CLIENT_SECRET": IDP_SECRET, "HEARTH_OPERATORS": "ops@hearth.test",
    "HEARTH_SSO_CLIENT_SECRET": IDP_SECRET})
idp = None
data = server.data
admin = server.admin
check = Checks()


def api(path, key, body=None):
    req = urllib.request.Request(url + path, method="POST" if body is not None else "GET",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


driver = None
try:
    url = server.wait_url()
    idp = subprocess.Popen(["node", PROVIDER_JS, str(idp_port), url + "/dashboard/sso/callback", IDP_SECRET],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if idp.stdout.readline().strip() != "ready":
        sys.exit("the OpenID Connect provider did not start")
    admin("tenant", "create", "acme")
    key_a = json.loads(admin("key", "create", "--tenant", "acme", "--name", "ops"))["key"]
    admin("tenant", "create", ODD)
    key_b = json.loads(admin("key", "create", "--tenant", ODD))["key"]
    admin("price", "set", "--model", "*", "--input", "1", "--cached-input", "0.1", "--output", "2")

    # Traffic: the same system prompt three times, so the later requests hit the prefix cache.
    want = {"requests": 0, "input": 0, "cached": 0, "output": 0}
    ids = []
    system = "You are a terse assistant for Acme's support desk. " * 6
    for q in ["Name a colour.", "Name a fruit.", "Name a city."]:
        status, r = api("/v1/chat/completions", key_a, {
            "model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
        check(f"chat {q!r}", status == 200, r)
        u = r["usage"]
        want["requests"] += 1
        want["input"] += u["prompt_tokens"]
        want["cached"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        want["output"] += u["completion_tokens"]
        ids.append(r["id"])

    wasm = os.path.join(data, "trivial.wasm")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([hearth, "processor", "build-wat",
                    os.path.join(root, "sdk/processors/examples/trivial/trivial.wat"), "-o", wasm], check=True)

    opts = webdriver.ChromeOptions()
    opts.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1360,1000",
                 f"--user-data-dir={tempfile.mkdtemp(prefix='hearth-chromium-')}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")), options=opts)
    driver.set_page_load_timeout(60)
    wait = WebDriverWait(driver, 30)

    def shot(name):
        if shots:
            driver.save_screenshot(os.path.join(shots, name))

    def no_alert():
        try:
            driver.switch_to.alert
            return False
        except NoAlertPresentException:
            return True

    def signed_in():
        try:
            wait.until(EC.presence_of_element_located((By.ID, "sign-out")))
        except Exception:
            print("sign-in failed at", driver.current_url, driver.page_source[:3000])
            raise

    def sign_in(credential, expect_ok=True):
        driver.get(url + "/dashboard")
        wait.until(EC.presence_of_element_located((By.ID, "credential")))
        if not driver.find_element(By.ID, "credential").is_displayed():
            driver.find_element(By.CSS_SELECTOR, "details summary").click()
        driver.find_element(By.ID, "credential").send_keys(credential)
        driver.find_element(By.ID, "sign-in").click()
        if expect_ok:
            signed_in()

    def member_sign_in(tenant, email, password):
        driver.get(url + "/dashboard")
        wait.until(EC.presence_of_element_located((By.ID, "email")))
        driver.find_element(By.ID, "tenant").send_keys(tenant)
        driver.find_element(By.ID, "email").send_keys(email)
        driver.find_element(By.ID, "password").send_keys(password)
        driver.find_element(By.ID, "member-sign-in-button").click()
        signed_in()

    def join(link, password):
        driver.get(link)
        wait.until(EC.presence_of_element_located((By.ID, "new-password")))
        driver.find_element(By.ID, "new-password").send_keys(password)
        driver.find_element(By.ID, "confirm-password").send_keys(password)
        driver.find_element(By.ID, "accept").click()
        signed_in()

    def sign_out():
        driver.find_element(By.ID, "sign-out").click()
        wait.until(EC.presence_of_element_located((By.ID, "credential")))

    def text(id_):
        return driver.find_element(By.ID, id_).text.strip()

    # ---- tenant A: usage --------------------------------------------------------------------
    driver.get(url + "/")
    check("/ leads to the sign-in form", "/dashboard/login" in driver.current_url, driver.current_url)
    if shots:
        shot("sign-in.png")
    sign_in(key_a)
    check("signed in as acme", text("tenant-name") == "acme", text("tenant-name"))
    got = {"requests": int(text("total-requests")), "input": int(text("total-input")),
           "cached": int(text("total-cached")), "output": int(text("total-output"))}
    check("usage numbers equal the API's usage", got == want, f"{got} != {want}")
    check("uncached + cached = input", int(text("total-uncached")) + got["cached"] == got["input"])
    check("charts drawn", len(driver.find_elements(By.CSS_SELECTOR, "#tokens-chart rect")) > 0)
    shot("usage.png")
    driver.get(url + "/dashboard/requests")
    page = driver.find_element(By.ID, "requests").text
    check("recent requests listed", page.count("req_") == len(ids), page[:300])
    shot("requests.png")

    # ---- keys: create (shown once), use, revoke ----------------------------------------------
    driver.get(url + "/dashboard/keys")
    driver.find_element(By.ID, "key-name").send_keys("browser-made")
    driver.find_element(By.ID, "key-expiry").send_keys("7")
    driver.find_element(By.ID, "create-key").click()
    wait.until(EC.presence_of_element_located((By.ID, "new-key")))
    new_key, new_id = text("new-key"), text("new-key-id")
    check("new key shown", new_key.startswith("hk_"), new_key)
    status, _ = api("/v1/models", new_key)
    check("new key works", status == 200, status)
    driver.get(url + "/dashboard/keys")
    check("secret not shown again", new_key not in driver.page_source)
    shot("keys.png")
    driver.find_element(By.ID, f"revoke-{new_id}").click()
    wait.until(EC.alert_is_present())
    driver.switch_to.alert.accept()
    wait.until(EC.text_to_be_present_in_element((By.ID, f"key-{new_id}"), "revoked"))
    status, body = api("/v1/models", new_key)
    check("revoked key gets 401", status == 401, (status, body))

    # ---- processors: upload, activate ----------------------------------------------------------
    driver.get(url + "/dashboard/processors")
    driver.find_element(By.ID, "processor-name").send_keys("trivial")
    driver.find_element(By.ID, "processor-file").send_keys(wasm)
    driver.find_element(By.ID, "upload").click()
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "button[id^='activate-']")))
    button = driver.find_element(By.CSS_SELECTOR, "button[id^='activate-']")
    pid = button.get_attribute("id")[len("activate-"):]
    button.click()
    wait.until(EC.presence_of_element_located((By.ID, f"deactivate-{pid}")))
    row = driver.find_element(By.ID, f"processor-{pid}").text
    check("processor uploaded and active", "trivial" in row and "active" in row, row)
    status, r = api("/v1/tenant/processors", key_a)
    check("the API agrees", status == 200 and any(p["id"] == pid and p["active"] for p in r["data"]), r)
    shot("processors.png")

    # ---- a LoRA adapter: both PEFT files chosen in one file input, uploaded, listed, used ------
    adapter_dir = os.path.join(data, "adapter")
    os.makedirs(adapter_dir, exist_ok=True)
    paths = []
    for name, blob in synthetic_adapter(rank=4):
        paths.append(os.path.join(adapter_dir, name))
        with open(paths[-1], "wb") as f:
            f.write(blob)
    driver.get(url + "/dashboard/adapters")
    driver.find_element(By.ID, "adapter-name").send_keys("house-style")
    driver.find_element(By.ID, "adapter-files").send_keys("\n".join(paths))
    driver.find_element(By.ID, "adapter-upload").click()
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "button[id^='delete-lora_']")))
    aid = driver.find_element(By.CSS_SELECTOR, "button[id^='delete-lora_']").get_attribute("id")[len("delete-"):]
    row = driver.find_element(By.ID, f"adapter-{aid}").text
    check("adapter uploaded and listed", "smollm2-135m-instruct:house-style" in row and "peft" in row, row)
    status, r = api("/v1/chat/completions", key_a, {
        "model": "smollm2-135m-instruct:house-style", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]})
    check("the adapter serves", status == 200, r)
    shot("adapters.png")

    # ---- a batch made through the API: its progress, cost and output on the Batches page ----
    good = lambda i: json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
                                          "messages": [{"role": "user", "content": f"Say {i}."}]}})
    fid = upload_batch_file(url, key_a, [good(1), good(2), "{not json"])
    status, batch = api("/v1/batches", key_a, {"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})
    check("batch created through the API", status == 200 and batch.get("status") == "in_progress", batch)
    bid = batch.get("id", "")
    for _ in range(240):
        status, batch = api(f"/v1/batches/{bid}", key_a)
        if batch.get("status") == "completed":
            break
        time.sleep(0.25)
    driver.get(url + "/dashboard/batches")
    row = driver.find_element(By.ID, f"batch-{bid}").text
    check("batch listed with its progress", "completed" in row and "2 answered, 1 failed of 3" in row, row)
    check("batch shows its cost so far", "$" in driver.find_element(By.CSS_SELECTOR, f"#batch-{bid} .cost").text, row)
    href = driver.find_element(By.CSS_SELECTOR, f"#batch-{bid} a.output").get_attribute("href")
    out = driver.execute_script("return fetch(arguments[0]).then(r => r.text())", href)
    check("the output downloads from the page", sorted(json.loads(l)["custom_id"] for l in out.splitlines())
          == ["line-1", "line-2"], out[:300])
    shot("batches.png")
    driver.get(url + "/dashboard/audit")
    audit = driver.find_element(By.ID, "audit").text
    check("audit shows the dashboard's actions",
          all(a in audit for a in ["key.create", "key.revoke", "processor.upload", "processor.activate",
                                   "adapter.upload"]), audit[:400])
    shot("audit.png")
    sign_out()

    # ---- tenant B, named like markup ---------------------------------------------------------
    sign_in(key_b)
    check("markup name shown as text", text("tenant-name") == ODD, text("tenant-name"))
    check("no script ran", no_alert())
    check("no element injected", len(driver.find_elements(By.CSS_SELECTOR, "header img, main img")) == 0)
    check("B sees no usage of A", text("total-requests") == "0", text("total-requests"))
    driver.get(url + "/dashboard/requests")
    check("B sees none of A's requests", "req_" not in driver.find_element(By.ID, "requests").text)
    driver.get(url + "/dashboard/keys")
    check("B sees none of A's keys", new_id not in driver.page_source and key_a.split("_")[1] not in driver.page_source)
    driver.get(url + "/dashboard/processors")
    check("B sees none of A's processors", pid not in driver.page_source)
    driver.get(url + "/dashboard/adapters")
    check("B sees none of A's adapters", aid not in driver.page_source and "house-style" not in driver.page_source)
    driver.get(url + "/dashboard/batches")
    check("B sees none of A's batches", bid not in driver.page_source)
    out = driver.execute_script("return fetch(arguments[0]).then(r => r.status)", href)
    check("B cannot download A's output", out == 404, out)
    sign_out()

    # ---- the operator -----------------------------------------------------------------------
    sign_in(ADMIN)
    names = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#tenants .tenant-name")]
    check("operator sees every tenant, names as text", "acme" in names and ODD in names, names)
    check("operator sees workers", len(driver.find_elements(By.CSS_SELECTOR, "table.workers tbody tr")) >= 1)
    check("no script ran for the operator", no_alert())
    shot("operator.png")
    # The console: a new tenant, its budget set from its drill-down; the CLI sees both.
    driver.find_element(By.ID, "new-tenant-name").send_keys("console-made")
    driver.find_element(By.ID, "create-tenant").click()
    wait.until(EC.presence_of_element_located((By.ID, "drill-tenant-name")))
    check("the console created a tenant", text("drill-tenant-name") == "console-made", text("drill-tenant-name"))
    driver.find_element(By.ID, "budget-usd").send_keys("25")
    driver.find_element(By.ID, "set-budget").click()
    wait.until(EC.alert_is_present())
    driver.switch_to.alert.accept()
    # The field holds "25" before the form is sent too: wait for the server's record of it.
    def budget_audited():
        return [e for e in json.loads(admin("audit", "--tenant", "console-made"))
                if e["action"] == "tenant.budget" and e["channel"] == "dashboard"
                and e["detail"]["monthly_nusd"] == 25_000_000_000]
    wait.until(lambda d: budget_audited())
    wait.until(lambda d: d.find_element(By.ID, "budget-usd").get_attribute("value").startswith("25"))
    shot("tenant.png")
    tenants = json.loads(admin("tenant", "list"))
    check("the CLI sees the console's tenant", any(t["name"] == "console-made" for t in tenants), tenants)
    check("the console's budget is audited", bool(budget_audited()))
    # A model added from the console (cold, for one tenant): the CLI sees it through the admin API.
    driver.get(url + "/dashboard")
    driver.find_element(By.ID, "model-id").send_keys("console-model")
    driver.find_element(By.ID, "model-source").send_keys("smollm2-135m-instruct")
    driver.find_element(By.ID, "model-tenants").send_keys("console-made")
    driver.find_element(By.ID, "add-model").click()
    wait.until(EC.alert_is_present())
    driver.switch_to.alert.accept()
    wait.until(EC.presence_of_element_located((By.ID, "model-console-model")))
    check("the console's model is listed, cold", "cold" in text("model-console-model"), text("model-console-model"))
    models = json.loads(subprocess.run([hearth, "admin", "--json", "--gateway-url", url, "model", "list"], check=True,
                                       capture_output=True, text=True, env=server.env).stdout)
    added = [m for m in models["data"] if m["id"] == "console-model"]
    check("the CLI sees the console's model, for its tenant only",
          len(added) == 1 and added[0]["tenants"] == ["console-made"], models)
    # A tenant's processors from the console: acme's is listed; the operator deactivates and
    # reactivates it, and the tenant's API sees each.
    acme_id = [t["id"] for t in tenants if t["name"] == "acme"][0]
    driver.get(f"{url}/dashboard/tenants/{acme_id}/processors")
    wait.until(EC.presence_of_element_located((By.ID, f"processor-{pid}")))
    check("the operator sees acme's processor", "trivial" in text(f"processor-{pid}"), text(f"processor-{pid}"))
    driver.find_element(By.ID, f"deactivate-{pid}").click()
    wait.until(EC.presence_of_element_located((By.ID, f"activate-{pid}")))
    status, r = api("/v1/tenant/processors", key_a)
    check("acme's API sees the operator's deactivation",
          status == 200 and any(p["id"] == pid and not p["active"] for p in r["data"]), r)
    driver.find_element(By.ID, f"activate-{pid}").click()
    wait.until(EC.presence_of_element_located((By.ID, f"deactivate-{pid}")))
    audit = json.loads(admin("audit", "--tenant", "acme"))
    check("the operator's processor actions are audited",
          any(e["action"] == "processor.deactivate" and e["actor"] == "admin" for e in audit), audit[:3])
    sign_out()

    # ---- members: an owner joins, invites a viewer, removes them ------------------------------
    owner_pw, viewer_pw = "owner's long password", "viewer's long password"
    inv = json.loads(admin("member", "invite", "--tenant", "acme", "--email", "Owner@Acme.test",
                           "--role", "owner", "--public-url", url))
    join(inv["url"], owner_pw)
    check("the owner joined and is signed in", (text("member"), text("role")) == ("owner@acme.test", "owner"),
          (text("member"), text("role")))
    driver.get(url + "/dashboard/members")
    driver.find_element(By.ID, "invite-email-input").send_keys("viewer@acme.test")
    driver.find_element(By.CSS_SELECTOR, "#invite-role-input option[value='viewer']").click()
    driver.find_element(By.ID, "invite").click()
    wait.until(EC.presence_of_element_located((By.ID, "invite-link")))
    viewer_link = text("invite-link")
    check("an invitation link", viewer_link.startswith(url + "/dashboard/invite/"), viewer_link)
    sign_out()
    join(viewer_link, viewer_pw)
    check("the viewer joined", text("role") == "viewer", text("role"))
    check("a viewer has no export", not driver.find_elements(By.ID, "export-csv"))
    check("a viewer has no audit log", "/dashboard/audit" not in driver.page_source)
    driver.get(url + "/dashboard/keys")
    check("a viewer sees keys but cannot create or revoke",
          "browser-made" in driver.page_source and not driver.find_elements(By.ID, "create-key")
          and not driver.find_elements(By.CSS_SELECTOR, "button[id^='revoke-']"))
    driver.get(url + "/dashboard/members")
    check("a viewer cannot invite", not driver.find_elements(By.ID, "invite"))
    sign_out()
    member_sign_in("acme", "owner@acme.test", owner_pw)
    driver.get(url + "/dashboard/members")
    shot("members.png")
    viewer_id = [e.get_attribute("id") for e in driver.find_elements(By.CSS_SELECTOR, "#members tbody tr")
                 if "viewer@acme.test" in e.text][0][len("member-"):]
    driver.find_element(By.ID, f"remove-{viewer_id}").click()
    wait.until(EC.alert_is_present())
    driver.switch_to.alert.accept()
    wait.until(EC.invisibility_of_element_located((By.ID, f"member-{viewer_id}")))
    check("the viewer is removed", "viewer@acme.test" not in driver.find_element(By.ID, "members").text)
    sign_out()
    sign_in(key_a, expect_ok=False)
    wait.until(EC.presence_of_element_located((By.ID, "login-error")))
    check("acme's key no longer signs in", "This tenant has members" in text("login-error"), text("login-error"))
    driver.get(url + "/dashboard/keys")
    check("signed out: back to the sign-in form", "/dashboard/login" in driver.current_url, driver.current_url)

    # ---- single sign-on through the tenant's and the operators' provider ----------------------
    def at_provider(login):
        """Signs in at the provider's development pages (any password) and consents."""
        wait.until(EC.presence_of_element_located((By.NAME, "login")))
        check(f"{login}: the provider's sign-in page", driver.current_url.startswith(IDP), driver.current_url)
        driver.find_element(By.NAME, "login").send_keys(login)
        driver.find_element(By.NAME, "password").send_keys("any password")
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        # The consent form is told by its hidden `prompt` field's value: the sign-in form has
        # one too (value "login"), so a wait on the name alone passed on the old page and
        # clicked its button as it went stale.
        consent = (By.CSS_SELECTOR, "input[name=prompt][value=consent]")
        wait.until(lambda d: not d.current_url.startswith(IDP) or d.find_elements(*consent))
        if driver.current_url.startswith(IDP):
            driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()

    def forget_provider():
        """Ends the provider's own session, so that the next sign-in there asks who it is."""
        driver.get(IDP + "/.well-known/openid-configuration")
        driver.delete_all_cookies()

    def sso_sign_in(tenant, login):
        forget_provider()
        driver.get(url + "/dashboard/login")
        driver.find_element(By.ID, "sso-tenant").send_keys(tenant)
        driver.find_element(By.ID, "sso-sign-in-button").click()
        at_provider(login)
        signed_in()

    admin("sso", "set", "--tenant", "acme", "--issuer", IDP, "--client-id", "hearth")
    admin("member", "invite", "--tenant", "acme", "--email", "boss@acme.test", "--role", "owner")
    admin("member", "invite", "--tenant", "acme", "--email", "watcher@acme.test", "--role", "viewer")
    sso_sign_in("acme", "boss@acme.test")
    check("the provider's owner is signed in", (text("member"), text("role")) == ("boss@acme.test", "owner"),
          (text("member"), text("role")))
    driver.get(url + "/dashboard/keys")
    check("an owner may create keys", bool(driver.find_elements(By.ID, "create-key")))
    driver.get(url + "/dashboard/members")
    check("an owner may invite", bool(driver.find_elements(By.ID, "invite")))
    sign_out()
    sso_sign_in("acme", "watcher@acme.test")
    check("the provider's viewer is signed in", (text("member"), text("role")) == ("watcher@acme.test", "viewer"),
          (text("member"), text("role")))
    driver.get(url + "/dashboard/keys")
    check("a viewer signed in through the provider cannot create keys",
          not driver.find_elements(By.ID, "create-key"))
    members = json.loads(admin("member", "list", "--tenant", "acme"))
    watcher = [m for m in members if m["email"] == "watcher@acme.test"][0]
    admin("member", "remove", watcher["id"])
    driver.get(url + "/dashboard/keys")
    check("the removed viewer is refused at its next request", "/dashboard/login" in driver.current_url,
          driver.current_url)
    forget_provider()
    driver.get(url + "/dashboard/login")
    driver.find_element(By.ID, "sso-tenant").send_keys("acme")
    driver.find_element(By.ID, "sso-sign-in-button").click()
    at_provider("watcher@acme.test")
    wait.until(EC.presence_of_element_located((By.ID, "login-error")))
    check("the removed viewer cannot sign in again", "not a member" in text("login-error"), text("login-error"))
    # Operators: one on the list signs in (and is named in the audit log); a member is not one.
    forget_provider()
    driver.get(url + "/dashboard/login")
    driver.find_element(By.ID, "operator-sso").click()
    at_provider("boss@acme.test")
    wait.until(EC.presence_of_element_located((By.ID, "login-error")))
    check("a tenant's member is no operator", "not one of this installation's operators" in text("login-error"),
          text("login-error"))
    forget_provider()
    driver.get(url + "/dashboard/login")
    driver.find_element(By.ID, "operator-sso").click()
    at_provider("ops@hearth.test")
    signed_in()
    check("the operator signed in through the provider", bool(driver.find_elements(By.ID, "tenants")))
    audit = json.loads(admin("audit", "--limit", "200"))
    check("the operator's sign-in is audited under its address",
          any(e["actor"] == "operator:ops@hearth.test" and e["action"] == "session.sign_in" for e in audit),
          [e["actor"] for e in audit[:5]])
    check("the members' sign-ins name the method",
          any(e["action"] == "session.sign_in" and e["detail"].get("method") == "oidc"
              and "boss@acme.test" in e["actor"] for e in audit), audit[:5])
    sign_out()
    # `hearth admin login`: the CLI signs the operator in through this browser, then acts
    # through the admin API without the admin token, audited under the operator's address.
    cli_env = {k: v for k, v in server.env.items() if k != "HEARTH_ADMIN_TOKEN"}
    cli_env["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="hearth-cli-config-")
    no_token = subprocess.run([hearth, "admin", "--gateway-url", url, "tenant", "list"], capture_output=True,
                              text=True, env=cli_env)
    check("without a token or a session the CLI is told to sign in",
          no_token.returncode != 0 and "sign in with" in no_token.stderr, no_token.stderr)
    login = subprocess.Popen([hearth, "admin", "--gateway-url", url, "login", "--no-browser"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env)
    link = code = ""
    for line in login.stderr:
        if "/dashboard/sso/operator?" in line:
            link = line.strip()
        if "shows the code" in line:
            code = line.strip().rsplit(" ", 1)[1].rstrip(".")
            break
    check("hearth admin login prints the sign-in link", link.startswith(url) and len(code) == 9, (link, code))
    forget_provider()
    driver.get(link)
    at_provider("ops@hearth.test")
    wait.until(EC.presence_of_element_located((By.ID, "continue")))
    check("the page asks to confirm the command line's code", code in driver.page_source, driver.page_source[:500])
    driver.find_element(By.ID, "continue").click()
    out, _ = login.communicate(timeout=60)
    check("hearth admin login signed the operator in", login.returncode == 0 and "ops@hearth.test" in out, out)
    made = subprocess.run([hearth, "admin", "--json", "--gateway-url", url, "tenant", "create", "cli-sso-made"],
                          capture_output=True, text=True, env=cli_env)
    check("the CLI acts with the operator's session alone", made.returncode == 0, made.stderr)
    audit = json.loads(admin("audit", "--tenant", "cli-sso-made"))
    check("the CLI's change is audited under the operator's address",
          any(e["action"] == "tenant.create" and e["actor"] == "operator:ops@hearth.test" and e["channel"] == "api"
              for e in audit), audit)
    with open(os.path.join(cli_env["XDG_CONFIG_HOME"], "hearth", "operator-sessions.json")) as f:
        session_token = json.load(f)[url]["token"]
    status, _ = api("/admin/v1/tenants", session_token)
    check("the kept session is an admin bearer token", status == 200, status)
    out = subprocess.run([hearth, "admin", "--gateway-url", url, "logout"], capture_output=True, text=True,
                         env=cli_env).stdout
    check("hearth admin logout says it signed out", "Signed out of" in out, out)
    status, _ = api("/admin/v1/tenants", session_token)
    check("after logout the gateway refuses that session", status == 401, status)
finally:
    if driver is not None:
        driver.quit()
    if idp is not None:
        idp.terminate()
    server.stop()

check.exit("dashboard browser check")
