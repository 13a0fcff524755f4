# rblk: common tasks. `make help` lists them.
# The one test command is scripts/test.sh (what CI runs, via .ci/run).

GO        ?= $(shell command -v go 2>/dev/null || echo /usr/local/go/bin/go)
PREFIX    ?= /usr/local
BINDIR    ?= $(PREFIX)/bin
UNITDIR   ?= /etc/systemd/system
CONFDIR   ?= /etc/rblk
MANDIR    ?= $(PREFIX)/share/man
BASHCOMPDIR ?= $(PREFIX)/share/bash-completion/completions
ZSHCOMPDIR  ?= $(PREFIX)/share/zsh/site-functions
FISHCOMPDIR ?= $(PREFIX)/share/fish/vendor_completions.d
UDEVDIR   ?= /etc/udev/rules.d
FUZZTIME  ?= 10s
GOBIN_DIR := $(shell $(GO) env GOPATH 2>/dev/null)/bin
STATICCHECK ?= $(shell command -v staticcheck 2>/dev/null || echo $(GOBIN_DIR)/staticcheck)
# The verbs provider is built when rdma-core's headers are installed
# (apt-get install libibverbs-dev librdmacm-dev); without them, --transport
# rdma says how to get it and auto uses tcp.
TAGS      ?= $(shell test -e /usr/include/infiniband/verbs.h -a -e /usr/include/rdma/rdma_cma.h && echo rdma)

.PHONY: all help build docs test unit e2e vm-test fuzz bench bench-bundle gobench lint quickstart install uninstall clean

all: build

help:
	@echo "make build       bin/rblkd, bin/rblk-attach and bin/rblk-mirror (with the verbs provider when rdma-core headers exist)"
	@echo "make test        scripts/test.sh: installs tools, runs every check (what CI runs)"
	@echo "make unit        go test -race ./... (but e2e)"
	@echo "make e2e         the end-to-end tests of e2e/ (no skipping: RBLK_E2E_REQUIRE=1)"
	@echo "make vm-test     scripts/vm-test.sh: every guest scenario (e2e over verbs on the NBD socket and /dev/nbdN, soak,"
	@echo "                 csi-sanity, ublk, the fio table) on kernels 6.1 and 6.12 (make test runs a share of it on each)"
	@echo "make fuzz        every fuzz target of protocol/ for FUZZTIME=$(FUZZTIME) each"
	@echo "make bench       bench/bench.sh: rblk beside nbdkit and qemu-nbd (bare), then beside NVMe-oF RDMA (guest);"
	@echo "                 table.md, results.json and plots in bench/out/DATE (RBLK_BENCH_SKIP_VM=1: bare only)"
	@echo "make bench-bundle bench/out/rblk-bench.tar.xz and run.sh: make bench's bare part for a machine without"
	@echo "                 packages (static rblk, fio, nbdkit and their libraries; bench/bundle/README.md)"
	@echo "make gobench     the go benchmarks (go test -bench)"
	@echo "make lint        gofmt, go vet, staticcheck"
	@echo "make quickstart  scripts/quickstart.sh (root)"
	@echo "make docs        man pages and bash/zsh/fish completions in bin/docs (gen-docs)"
	@echo "make install     binaries to $(BINDIR), systemd units to $(UNITDIR), example env files to $(CONFDIR),"
	@echo "                 man pages to $(MANDIR)/man1, shell completions, the udev rule to $(UDEVDIR)"
	@echo "make clean       remove bin/"

build:
	$(GO) build -tags '$(TAGS)' -o bin/ ./cmd/rblkd ./cmd/rblk-attach ./cmd/rblk-mirror

# The man pages and completions, from the commands themselves.
docs: build
	rm -rf bin/docs
	bin/rblkd gen-docs bin/docs
	bin/rblk-attach gen-docs bin/docs
	bin/rblk-mirror gen-docs bin/docs

test:
	bash scripts/test.sh

unit:
	$(GO) test -race -count=1 $$($(GO) list ./... | grep -v '/e2e$$')

e2e:
	RBLK_E2E_REQUIRE=1 $(GO) test -count=1 -v -timeout 15m ./e2e/

vm-test:
	bash scripts/vm-test.sh

fuzz:
	@set -e; for pkg in $$($(GO) list ./protocol/...); do \
		for t in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
			echo "== $$pkg $$t ($(FUZZTIME))"; \
			$(GO) test -run='^$$' -fuzz="^$$t\$$" -fuzztime=$(FUZZTIME) $$pkg; \
		done; \
	done

bench:
	bash bench/bench.sh

bench-bundle:
	mkdir -p bench/out
	bash bench/bundle/make-bundle.sh bench/out/rblk-bench.tar.xz
	cp bench/bundle/run.sh bench/out/run.sh
	@echo "copy bench/out/rblk-bench.tar.xz and bench/out/run.sh to the machine (one folder), then: OUT=DIR bash run.sh"

gobench:
	$(GO) test -run='^$$' -bench=. ./...

lint:
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt -l:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(STATICCHECK) ./...

quickstart:
	bash scripts/quickstart.sh

install: build docs
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(CONFDIR) $(DESTDIR)$(MANDIR)/man1 \
		$(DESTDIR)$(BASHCOMPDIR) $(DESTDIR)$(ZSHCOMPDIR) $(DESTDIR)$(FISHCOMPDIR) $(DESTDIR)$(UDEVDIR)
	install -m 0755 bin/rblkd bin/rblk-attach bin/rblk-mirror $(DESTDIR)$(BINDIR)/
	install -m 0644 systemd/rblkd.service systemd/rblk-attach@.service systemd/rblk-mirror@.service $(DESTDIR)$(UNITDIR)/
	install -m 0644 bin/docs/man1/*.1 $(DESTDIR)$(MANDIR)/man1/
	install -m 0644 bin/docs/bash-completion/rblkd bin/docs/bash-completion/rblk-attach bin/docs/bash-completion/rblk-mirror $(DESTDIR)$(BASHCOMPDIR)/
	install -m 0644 bin/docs/zsh/_rblkd bin/docs/zsh/_rblk-attach bin/docs/zsh/_rblk-mirror $(DESTDIR)$(ZSHCOMPDIR)/
	install -m 0644 bin/docs/fish/rblkd.fish bin/docs/fish/rblk-attach.fish bin/docs/fish/rblk-mirror.fish $(DESTDIR)$(FISHCOMPDIR)/
	sed 's|/usr/local/bin/|$(BINDIR)/|g' systemd/99-rblk.rules > $(DESTDIR)$(UDEVDIR)/99-rblk.rules
	chmod 0644 $(DESTDIR)$(UDEVDIR)/99-rblk.rules
	@if [ -z "$(DESTDIR)" ] && command -v udevadm >/dev/null 2>&1 && [ -d /run/udev ]; then udevadm control --reload; fi
	install -m 0644 systemd/rblkd.yaml.example $(DESTDIR)$(CONFDIR)/rblkd.yaml.example
	@# Example settings: never overwrite a file the administrator edited.
	@for f in rblkd.env attach-vol0.env mirror-vol0.env; do \
		if [ -e $(DESTDIR)$(CONFDIR)/$$f ]; then echo "keeping $(DESTDIR)$(CONFDIR)/$$f"; \
		else install -m 0644 systemd/$$f.example $(DESTDIR)$(CONFDIR)/$$f; echo "installed $(DESTDIR)$(CONFDIR)/$$f"; fi; \
	done
	@# This host's identity (as nvme-cli's hostnqn): kept if it exists.
	@if [ -e $(DESTDIR)$(CONFDIR)/hostid ]; then echo "keeping $(DESTDIR)$(CONFDIR)/hostid"; \
	else cat /proc/sys/kernel/random/uuid > $(DESTDIR)$(CONFDIR)/hostid && chmod 0644 $(DESTDIR)$(CONFDIR)/hostid && \
		echo "created $(DESTDIR)$(CONFDIR)/hostid: $$(cat $(DESTDIR)$(CONFDIR)/hostid)"; fi
	@if [ -z "$(DESTDIR)" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "Edit $(CONFDIR)/rblkd.env, then: systemctl enable --now rblkd"
	@echo "Per volume: $(CONFDIR)/attach-NAME.env, then: systemctl enable --now rblk-attach@NAME"

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/rblkd $(DESTDIR)$(BINDIR)/rblk-attach $(DESTDIR)$(BINDIR)/rblk-mirror
	rm -f $(DESTDIR)$(UNITDIR)/rblkd.service $(DESTDIR)$(UNITDIR)/rblk-attach@.service $(DESTDIR)$(UNITDIR)/rblk-mirror@.service
	rm -f $(DESTDIR)$(MANDIR)/man1/rblkd.1 $(DESTDIR)$(MANDIR)/man1/rblkd-*.1 \
		$(DESTDIR)$(MANDIR)/man1/rblk-attach.1 $(DESTDIR)$(MANDIR)/man1/rblk-attach-*.1 \
		$(DESTDIR)$(MANDIR)/man1/rblk-mirror.1 $(DESTDIR)$(MANDIR)/man1/rblk-mirror-*.1
	rm -f $(DESTDIR)$(BASHCOMPDIR)/rblkd $(DESTDIR)$(BASHCOMPDIR)/rblk-attach $(DESTDIR)$(BASHCOMPDIR)/rblk-mirror \
		$(DESTDIR)$(ZSHCOMPDIR)/_rblkd $(DESTDIR)$(ZSHCOMPDIR)/_rblk-attach $(DESTDIR)$(ZSHCOMPDIR)/_rblk-mirror \
		$(DESTDIR)$(FISHCOMPDIR)/rblkd.fish $(DESTDIR)$(FISHCOMPDIR)/rblk-attach.fish $(DESTDIR)$(FISHCOMPDIR)/rblk-mirror.fish
	rm -f $(DESTDIR)$(UDEVDIR)/99-rblk.rules

clean:
	rm -rf bin/
