//! The hook's installer, uninstaller and `register_exit`: the code that calls the
//! C API (`sys.monitoring`, `atexit`) with the GIL held to register the callbacks
//! and take them off. Apart from the callbacks: it runs once per attach, not per
//! event, and it is where the page's strings and definitions are used.

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use super::c_calls::{call, call_method, decref_rax, register_callback, Arg};
use super::{ApiConsts, HookParams, Route, METHOD_DEF};
use crate::hook::{
    AT_EXIT_MAX_TRIES, AT_EXIT_RETRY_EVENTS, STATUS_FAILED, STATUS_OK, STATUS_REMOVED,
    STATUS_RUNNING, ST_AT_EXIT, ST_AT_EXIT_MODULE, ST_AT_EXIT_RETRY, ST_AT_EXIT_TRIES,
    ST_CALLBACKS, ST_STATUS, TOOL_ID,
};

/// `PyCFunctionObject.m_ml`: the definition a builtin function was made from.
const CFUNCTION_ML: i32 = 16;

/// Emits the uninstaller at `uninstaller`.
pub(super) fn emit_uninstaller(
    a: &mut CodeAssembler,
    p: &HookParams,
    s: &ApiConsts,
    uninstaller: &mut CodeLabel,
) -> Result<(), IcedError> {
    let ApiConsts {
        s_monitoring,
        s_register,
        s_set,
        s_free,
        s_get_tool,
        s_name,
        s_iio,
        s_ii,
        s_i,
        s_at_unregister,
        s_o,
        defs,
        ..
    } = *s;
    // void uninstaller(void)
    a.set_label(uninstaller)?;
    a.push(rbx)?;
    a.push(r12)?;
    a.push(r13)?;
    let mut out = a.create_label();
    let events: &[(u32, u32)] = match &p.route {
        Route::Monitoring { events } => events,
        Route::Profile(_) => &[],
    };
    if !events.is_empty() {
        // The tool id is given back only while it is still pyprobe's: a program
        // that freed it and took it for itself keeps it, events and callbacks.
        call(a, p.symbols.sys_get_object, &[Arg::Imm(s_monitoring)])?;
        a.mov(rbx, rax)?;
        a.test(rbx, rbx)?;
        a.jz(out)?;
        call_method(a, p, s_get_tool, s_i, &[Arg::Imm(TOOL_ID as u64)])?;
        a.test(rax, rax)?;
        a.jz(out)?;
        a.mov(r12, rax)?;
        let mut named = a.create_label();
        a.xor(r13d, r13d)?;
        a.mov(rax, p.symbols.unicode_type)?;
        a.cmp(qword_ptr(r12 + 8), rax)?;
        a.jne(named)?;
        call(
            a,
            p.symbols.compare_ascii,
            &[Arg::Reg(r12), Arg::Imm(s_name)],
        )?;
        a.test(eax, eax)?;
        a.setz(r13b)?;
        a.set_label(&mut named)?;
        call(a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
        a.test(r13d, r13d)?;
        a.jz(out)?;
        // Each event's callback taken off; one that is not pyprobe's function
        // (the program registered its own) is put back, and counted in r13.
        a.xor(r13d, r13d)?;
        for (k, &(ev, _)) in events.iter().enumerate() {
            let def = defs + (k * METHOD_DEF) as u64;
            let mut next = a.create_label();
            let mut release = a.create_label();
            register_callback(a, p, (s_register, s_iio), ev, Arg::Imm(p.symbols.none))?;
            a.test(rax, rax)?;
            a.jz(next)?;
            a.mov(r12, rax)?;
            a.mov(rax, p.symbols.none)?;
            a.cmp(r12, rax)?;
            a.je(release)?;
            a.mov(rax, p.symbols.cfunction_type)?;
            let mut foreign = a.create_label();
            a.cmp(qword_ptr(r12 + 8), rax)?;
            a.jne(foreign)?;
            a.mov(rax, def)?;
            a.cmp(qword_ptr(r12 + CFUNCTION_ML), rax)?;
            a.je(release)?;
            a.set_label(&mut foreign)?;
            a.inc(r13d)?;
            register_callback(a, p, (s_register, s_iio), ev, Arg::Reg(r12))?;
            decref_rax(a, p)?;
            a.set_label(&mut release)?;
            call(a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
            a.set_label(&mut next)?;
        }
        // Events off and the id given back only when every callback was pyprobe's.
        a.test(r13d, r13d)?;
        a.jnz(out)?;
        call_method(a, p, s_set, s_ii, &[Arg::Imm(TOOL_ID as u64), Arg::Imm(0)])?;
        decref_rax(a, p)?;
        call_method(a, p, s_free, s_i, &[Arg::Imm(TOOL_ID as u64)])?;
        decref_rax(a, p)?;
    }
    a.set_label(&mut out)?;
    // atexit.unregister(the exit callback), through the module kept since.
    let mut no_exit = a.create_label();
    a.mov(rax, p.state_addr)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_RETRY as i32), 0)?;
    a.mov(r12, qword_ptr(rax + ST_AT_EXIT as i32))?;
    a.test(r12, r12)?;
    a.jz(no_exit)?;
    a.mov(rbx, qword_ptr(rax + ST_AT_EXIT_MODULE as i32))?;
    a.mov(qword_ptr(rax + ST_AT_EXIT as i32), 0)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_MODULE as i32), 0)?;
    call_method(a, p, s_at_unregister, s_o, &[Arg::Reg(r12)])?;
    decref_rax(a, p)?;
    call(a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
    call(a, p.symbols.dec_ref, &[Arg::Reg(rbx)])?;
    a.set_label(&mut no_exit)?;
    call(a, p.symbols.err_clear, &[])?;
    a.mov(rax, p.state_addr)?;
    a.mov(rcx, STATUS_REMOVED)?;
    a.mov(qword_ptr(rax + ST_STATUS as i32), rcx)?;
    a.pop(r13)?;
    a.pop(r12)?;
    a.pop(rbx)?;
    a.ret()?;
    Ok(())
}

/// Emits the installer at `installer` (monitoring route only), which calls
/// `uninstaller` and `register_exit`.
pub(super) fn emit_installer(
    a: &mut CodeAssembler,
    p: &HookParams,
    s: &ApiConsts,
    installer: &mut CodeLabel,
    uninstaller: CodeLabel,
    register_exit: CodeLabel,
) -> Result<(), IcedError> {
    let ApiConsts {
        s_monitoring,
        s_use,
        s_register,
        s_set,
        s_name,
        s_is,
        s_iio,
        s_ii,
        defs,
        ..
    } = *s;
    // void installer(void): registers the callbacks with sys.monitoring (the
    // profile route has none: pyprobe sets each thread's profile function itself).
    if let Route::Monitoring { events } = &p.route {
        let mask: u64 = events.iter().fold(0, |m, &(ev, _)| m | (1 << ev));
        a.set_label(installer)?;
        a.push(rbx)?;
        a.push(r12)?;
        a.push(r13)?;
        // Said before any call: a thread found outside this page with `status` 0
        // has not begun to install.
        a.mov(rax, p.state_addr)?;
        a.mov(qword_ptr(rax + ST_STATUS as i32), STATUS_RUNNING as i32)?;
        let mut fails: Vec<CodeLabel> = (0..5).map(|_| a.create_label()).collect();
        call(a, p.symbols.sys_get_object, &[Arg::Imm(s_monitoring)])?;
        a.mov(rbx, rax)?;
        a.test(rbx, rbx)?;
        a.jz(fails[0])?;
        call_method(
            a,
            p,
            s_use,
            s_is,
            &[Arg::Imm(TOOL_ID as u64), Arg::Imm(s_name)],
        )?;
        a.test(rax, rax)?;
        a.jz(fails[1])?;
        decref_rax(a, p)?;
        for (k, &(ev, _)) in events.iter().enumerate() {
            let def = defs + (k * METHOD_DEF) as u64;
            call(
                a,
                p.symbols.cfunction_new_ex,
                &[Arg::Imm(def), Arg::Imm(0), Arg::Imm(0)],
            )?;
            a.test(rax, rax)?;
            a.jz(fails[2])?;
            a.mov(r12, rax)?;
            a.mov(rax, p.state_addr)?;
            a.mov(qword_ptr(rax + (ST_CALLBACKS + 8 * k) as i32), r12)?;
            register_callback(a, p, (s_register, s_iio), ev, Arg::Reg(r12))?;
            a.mov(r13, rax)?;
            // The registry holds its own reference to the function.
            call(a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
            a.test(r13, r13)?;
            a.jz(fails[3])?;
            call(a, p.symbols.dec_ref, &[Arg::Reg(r13)])?;
        }
        call_method(
            a,
            p,
            s_set,
            s_ii,
            &[Arg::Imm(TOOL_ID as u64), Arg::Imm(mask)],
        )?;
        a.test(rax, rax)?;
        a.jz(fails[4])?;
        decref_rax(a, p)?;
        // The exit callback first: pyprobe, seeing `status` OK, reads whether it is in.
        a.call(register_exit)?;
        a.mov(rax, p.state_addr)?;
        a.mov(qword_ptr(rax + ST_STATUS as i32), STATUS_OK as i32)?;
        let mut leave = a.create_label();
        a.jmp(leave)?;
        for (k, l) in fails.iter_mut().enumerate() {
            a.set_label(l)?;
            call(a, p.symbols.err_clear, &[])?;
            if k >= 2 {
                // The tool id was taken: give it back (and whatever was registered).
                a.call(uninstaller)?;
            }
            a.mov(rax, p.state_addr)?;
            a.mov(
                qword_ptr(rax + ST_STATUS as i32),
                (STATUS_FAILED as i32) + k as i32 + 1,
            )?;
            a.jmp(leave)?;
        }
        a.set_label(&mut leave)?;
        a.pop(r13)?;
        a.pop(r12)?;
        a.pop(rbx)?;
        a.ret()?;
    }
    Ok(())
}

/// Emits `register_exit` at `register_exit`.
pub(super) fn emit_register_exit(
    a: &mut CodeAssembler,
    p: &HookParams,
    s: &ApiConsts,
    register_exit: &mut CodeLabel,
) -> Result<(), IcedError> {
    let ApiConsts {
        s_atexit,
        s_at_register,
        s_o,
        exit_def,
        ..
    } = *s;
    // void register_exit(void): atexit.register(the exit callback), GIL held. A
    // failure is cleared and tried again AT_EXIT_RETRY_EVENTS events later (the
    // interpreter may still be starting), AT_EXIT_MAX_TRIES times at most.
    a.set_label(register_exit)?;
    a.push(rbx)?;
    a.push(r12)?;
    a.push(r13)?;
    let mut exit_no_fn = a.create_label();
    let mut exit_no_module = a.create_label();
    let mut exit_out = a.create_label();
    call(a, p.symbols.import_module, &[Arg::Imm(s_atexit)])?;
    a.test(rax, rax)?;
    a.jz(exit_no_module)?;
    a.mov(rbx, rax)?;
    call(
        a,
        p.symbols.cfunction_new_ex,
        &[Arg::Imm(exit_def), Arg::Imm(0), Arg::Imm(0)],
    )?;
    a.test(rax, rax)?;
    a.jz(exit_no_fn)?;
    a.mov(r12, rax)?;
    call_method(a, p, s_at_register, s_o, &[Arg::Reg(r12)])?;
    a.test(rax, rax)?;
    let mut exit_refused = a.create_label();
    a.jz(exit_refused)?;
    decref_rax(a, p)?;
    // Both references kept: the uninstaller unregisters with them.
    a.mov(rax, p.state_addr)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT as i32), r12)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_MODULE as i32), rbx)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_RETRY as i32), 0)?;
    a.jmp(exit_out)?;
    a.set_label(&mut exit_refused)?;
    call(a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
    a.set_label(&mut exit_no_fn)?;
    call(a, p.symbols.dec_ref, &[Arg::Reg(rbx)])?;
    a.set_label(&mut exit_no_module)?;
    call(a, p.symbols.err_clear, &[])?;
    let mut give_up_exit = a.create_label();
    a.mov(rax, p.state_addr)?;
    a.inc(qword_ptr(rax + ST_AT_EXIT_TRIES as i32))?;
    a.cmp(
        qword_ptr(rax + ST_AT_EXIT_TRIES as i32),
        AT_EXIT_MAX_TRIES as i32,
    )?;
    a.jae(give_up_exit)?;
    a.mov(
        qword_ptr(rax + ST_AT_EXIT_RETRY as i32),
        AT_EXIT_RETRY_EVENTS as i32,
    )?;
    a.jmp(exit_out)?;
    a.set_label(&mut give_up_exit)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_RETRY as i32), 0)?;
    a.set_label(&mut exit_out)?;
    a.pop(r13)?;
    a.pop(r12)?;
    a.pop(rbx)?;
    a.ret()?;
    Ok(())
}
