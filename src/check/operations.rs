//! The same key on a second operation. A key belongs to one operation (the
//! draft's scope is the client and the resource, DESIGN §2 the client, the
//! endpoint and the key): a deposit, a refund or a drop sent with a key a
//! transfer already used is a request of its own. A service that keys by
//! the string alone replays the transfer's answer for it and does nothing
//! (Lakekeeper shipped "a drop reusing a create's key returned 204 without
//! dropping anything"), or refuses it as the transfer's key with another
//! body.

use super::http::{Http, Target, exchange, fill};
use super::{CheckError, Trace};

/// A transfer on key K, then the profile's second operation on K: the
/// second is made (a 2xx, unmarked, not the transfer's answer), its retry
/// replays its own answer, and the transfer's retry still replays the
/// transfer's.
pub(super) fn second_operation(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let Some(op) = &target.profile.second_operation else {
        t.skip("the profile declares no second_operation (a route besides the transfer's that takes keys)");
        return Ok(());
    };
    let k = target.key(21);
    let token = target.tokens[0].as_str();
    let first = target.post(t, Some(token), Some(&k), &target.transfer(23))?;
    t.expect(target.made(&first), || format!("the transfer was not made ({})", first.short()));
    let body = fill(&op.body, &target.src, &target.dst, 24).to_string();
    let headers = [("Authorization", format!("Bearer {token}")), ("Idempotency-Key", target.key_header(&k))];
    let send = |t: &mut Trace| -> Result<Http, CheckError> {
        let answer = exchange(target.address, &target.post_bytes_to(&op.path, &headers, &body))?;
        t.step(format!("POST {} key={k} {body} -> {}", op.path, answer.short()));
        Ok(answer)
    };
    let second = send(t)?;
    t.expect((200..300).contains(&second.status), || {
        format!("the second operation under the transfer's key was not made ({})", second.status)
    });
    t.expect(second.body != first.body, || "the second operation got the transfer's answer".into());
    t.expect(!target.replayed(&second), || "the second operation's first answer is marked a replay".into());
    let again = send(t)?;
    t.expect(target.replays(&again, &second), || "the second operation's retry is not its replay".into());
    let transfer_again = target.post(t, Some(token), Some(&k), &target.transfer(23))?;
    t.expect(target.replays(&transfer_again, &first), || {
        "the transfer's retry no longer replays the transfer".into()
    });
    Ok(())
}
