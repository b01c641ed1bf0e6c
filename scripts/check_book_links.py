"""Checks a built mdBook: every internal link and image points at a page or file that exists
in the output, and every #fragment at an id on that page. Links that leave the book (into
the repository around it) are errors too: the book is read without the repository.

Usage: check_book_links.py BOOK_OUTPUT_DIR
"""
import html.parser
import os
import sys
import urllib.parse

# mdBook's own pages: the print page repeats every chapter with rewritten links, and the
# 404 page's links are relative to wherever it is served from.
SKIP = {"print.html", "404.html", "toc.html"}


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key) and (key == "id" or tag == "a"):
                self.ids.add(a[key])
        if tag == "a" and a.get("href") is not None:
            self.links.append(a["href"])
        if tag in ("img", "script") and a.get("src"):
            self.links.append(a["src"])
        if tag == "link" and a.get("href"):
            self.links.append(a["href"])


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        with open(path, encoding="utf-8") as f:
            page.feed(f.read())
        cache[path] = page
    return cache[path]


def main():
    root = os.path.realpath(sys.argv[1])
    problems, checked = [], 0
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".html") or name in SKIP:
                continue
            path = os.path.join(folder, name)
            page = parse(path)
            where = os.path.relpath(path, root)
            for link in page.links:
                url = urllib.parse.urlsplit(link)
                if url.scheme or url.netloc or link.startswith("//"):
                    continue  # outside links are not checked (no network here)
                checked += 1
                target = path
                if url.path:
                    target = os.path.realpath(os.path.join(folder, urllib.parse.unquote(url.path)))
                    if os.path.isdir(target):
                        target = os.path.join(target, "index.html")
                if not (target == root or target.startswith(root + os.sep)):
                    problems.append(f"{where}: {link} leaves the book")
                    continue
                if not os.path.isfile(target):
                    problems.append(f"{where}: {link} does not exist")
                    continue
                fragment = urllib.parse.unquote(url.fragment)
                if fragment and target.endswith(".html") and fragment not in parse(target).ids:
                    problems.append(f"{where}: {link}: no #{fragment} on {os.path.relpath(target, root)}")
    for p in problems:
        print("broken link:", p, file=sys.stderr)
    if problems:
        sys.exit(f"{len(problems)} broken links in the book ({checked} checked)")
    print(f"book links: {checked} internal links and anchors, none broken")


if __name__ == "__main__":
    main()
