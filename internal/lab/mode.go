package lab

import (
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
)

// applyMode installs the translation of one mode on a lab that has none.
func (l *Lab) applyMode(mode Mode) error {
	switch mode {
	case ModeSocket:
		return l.attachSocketLB()
	case ModeTC:
		return l.attachTCLB()
	case ModeTCLegacy:
		return l.attachLegacyTCLB()
	case ModeNetfilter, ModeNowhere:
		if err := installKubeProxyRules(l.NodeNetNS()); err != nil {
			return fmt.Errorf("kube-proxy rules: %w", err)
		}
		// The only difference between the two: whether bridged frames pass
		// the IPv4 hooks at all.
		return l.setBridgeNFCallIPTables(mode == ModeNetfilter)
	}
	return fmt.Errorf("unknown lab mode %q", mode)
}

// clearMode removes every trace of any mode: the LB programs, the kube-proxy
// rules, the bridge's switch to the IPv4 hooks and the conntrack entries of
// translated flows.
func (l *Lab) clearMode() error {
	var errs []error
	for _, hook := range l.modeHooks() {
		errs = append(errs, detachLabPrograms(hook))
	}
	errs = append(errs,
		l.detachLegacyTCLB(),
		removeKubeProxyRules(l.NodeNetNS()),
		l.setBridgeNFCallIPTables(false),
		flushConntrack(l.NodeNetNS()),
	)
	return errors.Join(errs...)
}

func (l *Lab) setBridgeNFCallIPTables(on bool) error {
	val := "0"
	if on {
		val = "1"
	}
	return setSysctls(l.NodeNetNS(), map[string]string{bridgeNFCallIPTables: val})
}

const bridgeNFCallIPTables = "net.bridge.bridge-nf-call-iptables"

// flushConntrack empties the conntrack table of a netns.
func flushConntrack(netnsPath string) error {
	ns, err := openNetNS(netnsPath)
	if err != nil {
		return err
	}
	defer ns.Close()
	c, err := conntrack.Dial(&netlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		return fmt.Errorf("conntrack in %s: %w", netnsPath, err)
	}
	defer c.Close()
	if err := c.Flush(); err != nil {
		return fmt.Errorf("flush conntrack in %s: %w", netnsPath, err)
	}
	return nil
}
